"""`raykv bench tiers` without Ray: the memcpy limits copy with the client's own routine into the
same tensors, the peers' copy out is as parallel, and an e2e step that leaves the disk alone
fails its figure."""

import pytest

from cluster.core import copies
from cluster.tools.bench import common, disk, peers, tiers, tiers_host


@pytest.fixture
def copied(monkeypatch):
    """Every batch copies.copy_pages gets (through the modules that call it)."""
    batches = []
    real = copies.copy_pages

    def spy(pairs):
        batches.append(pairs)
        real(pairs)

    monkeypatch.setattr(tiers_host, "copy_pages", spy)
    monkeypatch.setattr(copies, "copy_pages", spy)
    return batches


def test_memcpy_limits_run_copy_pages_between_private_pages_and_the_sessions_tensors(copied):
    plan = tiers.SizePlan(tiers.MiB, 8, 3, 3, 3, "/tmp")
    kv = common.page_kv(tiers.SPEC, plan.page_tokens, plan.num_pages)
    session = tiers.Session(plan, None, kv, common.touched_like(kv))
    limits = tiers.memcpy_contenders(session)
    assert limits["memcpy_get"](0) > 0 and limits["memcpy_put"](0) > 0
    common.check_same(session.out, kv, "out")
    get_pairs, put_pairs = copied[0], copied[-1]
    assert len(copied) == 2 * (1 + tiers.GET_REPS)
    (get_dst, get_src), = get_pairs  # one block: every page, as a get copies a run of slots
    assert get_dst.data_ptr() == session.out.data_ptr()
    assert get_src.shape == get_dst.shape and get_src.permute(3, 0, 1, 2, 4, 5).is_contiguous()
    (put_dst, put_src), = put_pairs  # likewise, kv's pages into one private buffer
    assert put_src.data_ptr() == kv.data_ptr() and put_src.shape == put_dst.shape
    assert put_dst.permute(3, 0, 1, 2, 4, 5).is_contiguous()
    assert put_dst.data_ptr() != get_src.data_ptr()


@pytest.mark.parametrize("page_shape", [None, (2, 2, 4, 4, 1024)])
def test_peer_copy_out_uses_copy_pages_and_fills_the_kv_layout(copied, page_shape):
    pool = peers.page_pool(64 << 10, 4)
    read_only = [page.copy() for page in pool]
    for page in read_only:
        page.flags.writeable = False
    dst = peers.kv_windows(64 << 10, 4, page_shape)
    peers.copy_rows(dst, read_only)
    peers.check_pool(dst)
    assert len(copied) == 1 and len(copied[0]) == 4
    if page_shape:  # page 1 starts 4 tokens into one buffer, not after page 0's bytes
        assert dst[1].base is dst[0].base and not dst[1].flags.c_contiguous
        dst[0][0, 0, 0, 0, 0] ^= 1
        with pytest.raises(RuntimeError, match="page 0"):
            peers.check_pool(dst)


class _FakeSession:
    """What disk.e2e_contenders and fill_host use of a tiers.Session: a node whose disk stats
    move only when `demotes` / `reads_disk` say so."""

    def __init__(self, demotes: bool, reads_disk: bool, disk_pages: int = 0) -> None:
        self.plan = tiers.SizePlan(4096, 1, 2, 3, 3, "/tmp")
        self.demotes, self.reads_disk = demotes, reads_disk
        self.stats = {"disk_bytes_written": 0, "disk_bytes_read": 0,
                      "pages": {"disk": disk_pages}}
        self.unmet: dict[str, str] = {}
        self.got: list[int] = []
        self.room = 0  # batches the host tier still holds before a put demotes

    def node_stat(self, name):
        return self.stats[name]

    def disk_bytes_read(self):  # the node's and the client's own: one sum here
        return self.stats["disk_bytes_read"]

    def host_room_batches(self):
        return self.room

    def put_batch(self):
        if self.demotes:
            self.stats["disk_bytes_written"] += self.plan.batch_bytes + 4096
            self.stats["pages"]["disk"] += self.plan.num_pages

    def put_settled(self):  # the put and its background commit (which demotes)
        self.put_batch()

    def check_batch(self, batch):
        self.got.append(batch)
        self.stats["disk_bytes_read"] += self.plan.batch_bytes * self.reads_disk
        return 0.01

    expect = tiers.Session.expect


def test_e2e_steps_must_move_a_batch_through_the_disk_tier():
    session = _FakeSession(demotes=True, reads_disk=True)
    e2e = disk.e2e_contenders(session, 2)
    assert e2e["e2e_put"](0) > 0 and e2e["e2e_get"](0) > 0 and e2e["e2e_get"](1) > 0
    assert session.got == [1, 2, 3, 4] and session.unmet == {}
    lazy = _FakeSession(demotes=False, reads_disk=False)
    e2e = disk.e2e_contenders(lazy, 2)
    e2e["e2e_put"](0), e2e["e2e_get"](0)
    assert set(lazy.unmet) == {"e2e_put", "e2e_get"}


def test_fill_host_puts_until_enough_batches_are_on_disk_and_gives_up_otherwise():
    session = _FakeSession(demotes=True, reads_disk=True)
    assert disk.fill_host(session, 3)
    assert session.stats["pages"]["disk"] == 3 * session.plan.num_pages
    assert not disk.fill_host(_FakeSession(demotes=False, reads_disk=True), 3)


def test_fill_host_first_fills_the_room_the_host_tier_has_left():
    """--quick's 32 MiB batches leave the host tier 9 batches of room when the fill starts:
    a bound of the wanted batches and 5 stopped before any went down (its e2e ratios were
    then not exercised, and the run failed)."""
    class Roomy(_FakeSession):
        def put_batch(self):
            if self.room:
                self.room -= 1  # lands in free host room: nothing goes down yet
            else:
                super().put_batch()

    session = Roomy(demotes=True, reads_disk=True)
    session.room = 9
    assert disk.fill_host(session, 7)
    assert session.stats["pages"]["disk"] == 7 * session.plan.num_pages
