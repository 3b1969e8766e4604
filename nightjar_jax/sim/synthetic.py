"""A SYNTHETIC cost profile: a roofline *model* (not a measurement) of llama-7b + llama-68m on an H200-class GPU.

Use it when no measured profile exists; every profile it writes says `"kind": "synthetic-model"`.

Model of one decode step with B sequences of mean context L and γ drafts:

    target verify:  bytes = W_t + B·L·kv_t            flops = 2·P_t·B·(γ+1) + 4·layers_t·d_t·L·B·(γ+1)
    draft (γ times): bytes = W_d + B·L·kv_d            flops = 2·P_d·B
    each kernel:    t = max(t_mem, t_flop) + overlap·min(t_mem, t_flop) + launch overhead
    verify also pays per_token_overhead per verified position (logits, sampling, rejection)
    t_mem = bytes / (bandwidth · bandwidth_efficiency),  t_flop = flops / (peak_flops · compute_efficiency)

`overlap` = 0 is the ideal roofline, 1 is no overlap of memory and compute; real small-M GEMMs sit between.
At small B the step is weight-bandwidth bound, so verifying γ+1 tokens costs about as much as one: speculation
pays. As B grows the verify's flops grow with B·(γ+1) and overtake the bandwidth term: speculation stops paying
(the effect Nightjar exploits). Acceptance per position is an assumption typical of a small draft for a 7B
target, not a measurement.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from nightjar_jax.planner.base import is_int
from nightjar_jax.sim.profile import CostProfile

# fields that divide (a rate, an efficiency, a size): > 0; the other numbers are >= 0
_POSITIVE = ("target_params", "target_layers", "target_hidden", "target_kv_bytes_per_token", "bytes_per_param",
             "bandwidth", "peak_flops", "bandwidth_efficiency", "compute_efficiency", "prefill_compute_efficiency",
             "hbm_bytes", "page_size", "max_num_seqs")


@dataclasses.dataclass(frozen=True)
class RooflineModel:
    """Parameters of the synthetic model (defaults: llama-7b target, llama-68m draft, bf16, H200-class)."""

    target_params: float = 6.74e9
    target_layers: int = 32
    target_hidden: int = 4096
    target_kv_bytes_per_token: float = 2 * 32 * 4096 * 2  # K and V, 32 layers, 4096 wide (MHA), bf16
    draft_params: float = 68e6
    draft_kv_bytes_per_token: float = 2 * 2 * 768 * 2  # 2 layers, 768 wide
    bytes_per_param: float = 2.0
    bandwidth: float = 4.8e12  # bytes/s (H200 HBM3e)
    peak_flops: float = 989e12  # dense bf16
    bandwidth_efficiency: float = 0.75
    compute_efficiency: float = 0.25  # decode-time GEMMs with small M
    prefill_compute_efficiency: float = 0.6  # large-M prefill GEMMs
    overlap: float = 1.0
    target_overhead_seconds: float = 1.5e-3  # launch + sampling + host round trip per step
    per_token_overhead_seconds: float = 3e-6  # logits softmax / sampling / rejection per verified position
    draft_overhead_seconds: float = 0.45e-3  # per fused draft step
    acceptance_per_position: tuple[float, ...] = (0.52, 0.48, 0.45, 0.43, 0.42, 0.41)
    hbm_bytes: float = 141e9
    memory_utilisation: float = 0.9
    workspace_bytes: float = 4e9
    page_size: int = 16
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "acceptance_per_position":
                if not value or any(not (_real(a) and 0 <= a <= 1) for a in value):
                    raise ValueError(f"acceptance_per_position must be numbers in [0, 1] (at least one), got {value!r}")
                continue
            if f.name in ("target_layers", "target_hidden", "page_size", "max_num_seqs") and not is_int(value):
                raise ValueError(f"{f.name} must be an int >= 1, got {value!r}")
            positive = f.name in _POSITIVE
            if not (_real(value) and math.isfinite(value) and (value > 0 if positive else value >= 0)):
                raise ValueError(f"{f.name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")

    def _kernel(self, bytes_moved: float, flops: float, overhead: float) -> float:
        t_mem = bytes_moved / (self.bandwidth * self.bandwidth_efficiency)
        t_flop = flops / (self.peak_flops * self.compute_efficiency)
        return max(t_mem, t_flop) + self.overlap * min(t_mem, t_flop) + overhead

    def step_seconds(self, batch: int, gamma: int, context: float) -> float:
        tokens = batch * (gamma + 1)
        target = self._kernel(
            self.target_params * self.bytes_per_param + batch * context * self.target_kv_bytes_per_token,
            2 * self.target_params * tokens + 4 * self.target_layers * self.target_hidden * context * tokens,
            self.target_overhead_seconds + self.per_token_overhead_seconds * tokens,
        )
        draft_step = self._kernel(
            self.draft_params * self.bytes_per_param + batch * context * self.draft_kv_bytes_per_token,
            2 * self.draft_params * batch,
            self.draft_overhead_seconds,
        )
        return target + gamma * draft_step

    def prefill_per_token_seconds(self) -> float:
        flops = 2 * (self.target_params + self.draft_params)
        return flops / (self.peak_flops * self.prefill_compute_efficiency)

    def catchup_per_token_seconds(self) -> float:
        return 2 * self.draft_params / (self.peak_flops * self.compute_efficiency) + self.draft_kv_bytes_per_token / (
            self.bandwidth * self.bandwidth_efficiency
        )

    def kv_budget_pages(self) -> int:
        free = (
            self.hbm_bytes * self.memory_utilisation
            - (self.target_params + self.draft_params) * self.bytes_per_param
            - self.workspace_bytes
        )
        per_page = self.page_size * (self.target_kv_bytes_per_token + self.draft_kv_bytes_per_token)
        return int(free // per_page)


def build_synthetic_profile(
    model: RooflineModel | None = None,
    *,
    gamma_max: int = 6,
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256),
    context_lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096),
) -> CostProfile:
    """Tabulate `model` on a grid as a CostProfile labelled "synthetic-model"."""
    model = model or RooflineModel()
    if not is_int(gamma_max) or not 1 <= gamma_max <= len(model.acceptance_per_position):
        raise ValueError(f"gamma_max must be an int in 1..{len(model.acceptance_per_position)} (the model's "
                         f"acceptance entries), got {gamma_max!r}")
    grid = tuple(
        tuple(tuple(model.step_seconds(b, g, c) for c in context_lengths) for g in range(gamma_max + 1))
        for b in batch_sizes
    )
    return CostProfile(
        batch_sizes=batch_sizes,
        gammas=tuple(range(gamma_max + 1)),
        context_lengths=context_lengths,
        step_seconds_grid=grid,
        acceptance_per_position=model.acceptance_per_position[:gamma_max],
        prefill_fixed_seconds=model.target_overhead_seconds
        + model.target_params * model.bytes_per_param / (model.bandwidth * model.bandwidth_efficiency),
        prefill_seconds_per_token=model.prefill_per_token_seconds(),
        catchup_fixed_seconds=2 * model.draft_overhead_seconds,
        catchup_seconds_per_token=model.catchup_per_token_seconds(),
        reload_seconds=model.draft_params * model.bytes_per_param / 25e9,  # PCIe-class host->device copy
        kv_budget_pages=model.kv_budget_pages(),
        page_size=model.page_size,
        max_num_seqs=model.max_num_seqs,
        kind="synthetic-model",
        label="SYNTHETIC roofline model: llama-7b target + llama-68m draft, bf16, H200-class GPU",
        notes=(
            "A model, not a measurement: roofline step times from nightjar_jax.sim.synthetic.RooflineModel "
            f"with {dataclasses.asdict(model)}. Replace with a profile measured by the engine for real claims."
        ),
        device="H200-class (modelled)",
        target="llama-7b (modelled)",
        draft="llama-68m (modelled)",
    )


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
