"""Hardware profiles of the cluster simulator: what a node holds and how fast it moves KV.

Every figure is public; the sources (fetched 2026-12):

  [H100]   NVIDIA H100 Tensor Core GPU datasheet, SXM5: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS
           dense BF16 (1,979 with sparsity), PCIe Gen5 128 GB/s (64 GB/s each way).
           https://www.nvidia.com/en-us/data-center/h100/
  [H200]   NVIDIA H200 datasheet, SXM: 141 GB HBM3e, 4.8 TB/s, the same 989 TFLOPS dense BF16,
           PCIe Gen5 128 GB/s. https://www.nvidia.com/en-us/data-center/h200/
  [DGX]    NVIDIA DGX H100/H200 user guide: 8 GPUs, 2 TB of system memory, 8 x 3.84 TB
           NVMe U.2 data drives, ConnectX-7 400 Gb/s networking.
           https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html
  [NVMe]   Samsung PM1733 U.2 datasheet: 7,000 MB/s sequential read, ~90 us read latency
           (a PCIe Gen4 drive of the class the DGX ships).
           https://semiconductor.samsung.com/ssd/enterprise-ssd/pm1733-pm1735/
  [NIC]    Ethernet line rates: 100 GbE = 12.5 GB/s, 400 GbE = 50 GB/s (IEEE 802.3ba/bs);
           NVIDIA ConnectX-7 datasheet (RDMA, sub-microsecond NIC latency; we take 10 us
           end to end per transfer for a switched RDMA path, 40 us over TCP at 100 GbE).
           https://www.nvidia.com/content/dam/en-zz/Solutions/networking/ethernet-adapters/connectx-7-datasheet-Final.pdf
  [Llama]  LLaMA 3 70B: 70.6 B parameters, 80 layers, d_model 8192, 8 KV heads of 128
           (Meta's model card, https://huggingface.co/meta-llama/Meta-Llama-3-70B); weights
           in BF16 are 141 GB; raykv's ModelSpec "llama-3.1-70b" has the same KV geometry.
  [Kaplan] Kaplan et al., "Scaling Laws for Neural Language Models", Table 1: forward FLOPs
           per token = 2 N + 2 n_layer n_ctx d_attn. https://arxiv.org/abs/2001.08361

Prefill throughput is derived, not measured: tokens/s = GPUs x peak dense BF16 FLOP/s x MFU /
(2 N), with MFU = 0.4 (an assumption for tensor-parallel prefill; no public LLaMA3-70B prefill
figure per node was found that states its context length), i.e. about 22k tokens/s for 8 x
H100 or H200 (prefill is compute-bound, so the H200's faster HBM does not change it). The
attention term of [Kaplan] makes prefill quadratic in the context: prefilling positions
[c, L) costs 2 N (L - c) + n_layer d_attn (L^2 - c^2) FLOPs (each position p attends to p
earlier ones).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cluster.core.spec import ModelSpec

GB = 10**9
TB = 10**12
MFU = 0.4


@dataclass(frozen=True, slots=True)
class ModelCost:
    """The served model: its prefill arithmetic and its KV bytes per token."""

    name: str
    num_params: float
    num_layers: int
    d_attn: int
    weight_bytes: int
    kv_bytes_per_token: int

    def prefill_flops(self, cached_tokens: int, total_tokens: int) -> float:
        """FLOPs to prefill positions [cached_tokens, total_tokens) ([Kaplan], causal)."""
        new = max(0, total_tokens - cached_tokens)
        attention = self.num_layers * self.d_attn * (total_tokens**2 - min(cached_tokens,
                                                                             total_tokens)**2)
        return 2 * self.num_params * new + attention


def llama3_70b() -> ModelCost:
    spec = ModelSpec.preset("llama-3.1-70b")
    return ModelCost("llama3-70b", 70.6e9, spec.num_layers, 8192, 141 * GB,
                     spec.bytes_per_token)


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One node kind: capacities raykv may use per tier, and how fast each path moves bytes."""

    name: str
    num_gpus: int
    hbm_bytes: int  # the node's total
    dense_flops: float  # per GPU, BF16
    device_kv_bytes: int  # raykv's device tier
    host_kv_bytes: int  # raykv's host tier (DRAM)
    disk_kv_bytes: int  # raykv's disk tier (NVMe)
    hbm_bytes_per_s: float  # node total
    host_to_device_bytes_per_s: float  # node total over PCIe
    disk_bytes_per_s: float  # node total NVMe read
    nic_bytes_per_s: float
    host_latency_s: float
    disk_latency_s: float
    nic_latency_s: float

    def prefill_tokens_per_s(self, model: ModelCost) -> float:
        """Linear-term throughput: GPUs x peak x MFU / (2 N)."""
        return self.num_gpus * self.dense_flops * MFU / (2 * model.num_params)

    def attention_s_per_pair(self, model: ModelCost) -> float:
        """Attention-term seconds per token pair (total^2 - cached^2, prefill_flops)."""
        return model.num_layers * model.d_attn / (self.num_gpus * self.dense_flops * MFU)

    def prefill_s(self, model: ModelCost, cached_tokens: int, total_tokens: int) -> float:
        return model.prefill_flops(cached_tokens, total_tokens) / (
            self.num_gpus * self.dense_flops * MFU)


def _kv_device_bytes(hbm_bytes: int, model: ModelCost) -> int:
    """Half of what the weights and a 10 % engine reserve leave: the rest is the running
    batch's own KV."""
    return int((0.9 * hbm_bytes - model.weight_bytes) / 2)


def _profile(name: str, gpu_hbm_bytes: int, hbm_bw: float, nic_gbit: int) -> HardwareProfile:
    model = llama3_70b()
    hbm = 8 * gpu_hbm_bytes
    nic_latency_s = 10e-6 if nic_gbit >= 400 else 40e-6
    return HardwareProfile(
        name=name, num_gpus=8, hbm_bytes=hbm, dense_flops=989e12,
        device_kv_bytes=_kv_device_bytes(hbm, model),
        host_kv_bytes=1 * TB,  # half of the DGX's 2 TB [DGX]
        disk_kv_bytes=int(2 * 3.84 * TB),  # two of its eight U.2 drives [DGX]
        hbm_bytes_per_s=8 * hbm_bw,
        host_to_device_bytes_per_s=8 * 50 * GB,  # 64 GB/s a way per GPU [H100], ~80 % of it
        disk_bytes_per_s=2 * 7 * GB,  # two drives [NVMe]
        nic_bytes_per_s=nic_gbit / 8 * GB,
        host_latency_s=10e-6, disk_latency_s=90e-6, nic_latency_s=nic_latency_s)


PROFILES: dict[str, HardwareProfile] = {
    "h100-100g": _profile("h100-100g", 80 * GB, 3.35 * TB, 100),
    "h100-400g": _profile("h100-400g", 80 * GB, 3.35 * TB, 400),
    "h200-100g": _profile("h200-100g", 141 * GB, 4.8 * TB, 100),
    "h200-400g": _profile("h200-400g", 141 * GB, 4.8 * TB, 400),
}
DEFAULT_PROFILE = "h100-400g"


def dram_only(profile: HardwareProfile, model: ModelCost, num_tokens: int,
              block_tokens: int) -> HardwareProfile:
    """`profile` whose only KV tier is DRAM (host) of `num_tokens` tokens of `model`'s KV,
    rounded down to whole blocks: no device or disk tier. Its compute, PCIe and NIC figures
    stay. Mooncake's local cache (Qin et al., FAST'25, 5.3.1: ~1 TB of DRAM a node, about
    3M tokens of LLaMA3-70B's 320 KB a token) is
    `dram_only(profile, llama3_70b(), 3_000_000, 512)`.
    """
    page_bytes = block_tokens * model.kv_bytes_per_token
    return replace(profile, name=f"{profile.name}-dram-{num_tokens}",
                   device_kv_bytes=0, host_kv_bytes=num_tokens // block_tokens * page_bytes,
                   disk_kv_bytes=0)
