"""The data plane: pages move between processes over a transport, Ray stays the control plane.

    reader                                   owner (a node actor's PageServer)
    READ(geometry, keys)  ------------->     pins the longest local prefix (on its loop)
                          <-------------     header(num_pages), then each page's bytes,
                                             straight from the slab
    ACK                   ------------->     checks the pinned slots' generations
                          <-------------     verdict: how many leading pages are good
                                             (the pins are released only now)

See docs/dataplane.md for the transports measured and why TCP was chosen.
"""
