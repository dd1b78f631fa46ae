"""Every constant the planner's verdicts rest on: nominal value, plausible range and source, in one table.

A constant either only changes *time* (``retime=True``: a finished closed-loop run can be re-timed with
:func:`dhisparse_planner.retime.retime`) or changes what the KV manager decides (memory, selections,
acceptance: the run must be simulated again). Ranges are stated for the reference setup (H200, GLM-5.x
IndexShare NVFP4, DFlash2); for other presets a range keeps its *relative* width around the preset's value
(``relative=True``) or is used as is (fractions). A constant without a source says so and gets a wide range.
The locality constants are calibrated (:mod:`dhisparse_planner.calibrate`); their entries here are the
defaults that calibration replaces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dhisparse.kv.policies import KV_POLICIES, policy_named
from dhisparse_planner import paper
from dhisparse_planner.admission import TokenBudget
from dhisparse_planner.locality import LocalityModel
from dhisparse_planner.specs import DrafterSpec, HardwareSpec, ModelSpec
from dhisparse_planner.speculation import ACCEPTANCE, SpeculationModel

TARGETS = ("hardware", "model", "drafter", "speculation", "locality", "admission")


@dataclass(frozen=True)
class Constant:
    """Attributes:
        name: label in tables and plots.
        target / field: which spec holds it (``hardware`` HardwareSpec, ``model`` ModelSpec, ``drafter``
            DrafterSpec, ``speculation`` SpeculationModel, ``locality`` LocalityModel, ``admission`` a baseline's
            TokenBudget) and the field name.
        value / low / high: nominal value and plausible range (reference setup, field units).
        unit / scale: display unit and the factor from field units to it.
        source: where the value and the range come from ("no source" when there is none).
        retime: True if the constant only changes time (see module docstring).
        relative: for other presets, scale the range with the preset's value.
    """

    name: str
    target: str
    field: str
    value: float
    low: float
    high: float
    unit: str
    scale: float
    source: str
    retime: bool
    relative: bool = True

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"Constant.target must be one of {TARGETS}, got {self.target!r}")
        if not self.low <= self.value <= self.high:
            raise ValueError(f"Constant {self.name}: need low <= value <= high, got {self.low}, {self.value}, "
                             f"{self.high}")

    def range_around(self, current: float) -> tuple[float, float]:
        """The plausible range for a setup whose value is ``current``."""
        if not self.relative or self.value == 0:
            return self.low, self.high
        return current * self.low / self.value, current * self.high / self.value


CONSTANTS: tuple[Constant, ...] = (
    Constant("host link (effective, row gathers)", "hardware", "host_link_bytes_per_s", 25e9, 15e9, 35e9, "GB/s",
             1e-9, "nvbandwidth issue #24: SM-initiated host->device copies reach 35.2 GB/s on H100 (large "
             "contiguous buffers; upper end); nvbandwidth issue #42: 25.1 GB/s falling to 16.5 GB/s on A100 for "
             "large buffers. No published figure for gathered 656-byte rows on H200: the nominal is ASSUMED. "
             "Measured (ours): 24.1 GB/s gathering 6,400 rows of 656 B from the host store mapped into an H200 "
             "(docs/results/gpu_check/gpu_check.json, mapped_host.mapped_gather_656B, committed 2026-11-30 in "
             "e791645), 4.7 / 0.58 GB/s at 800 / 100 rows (a ~110 us cost per gather); summary.md's rows 'host link "
             "measured' are re-timed with it.", retime=True),
    Constant("step overhead", "hardware", "step_overhead_s", 0.012, 0.006, 0.018, "ms", 1e3,
             "no source for H200 TP8 (ASSUMED). Upper end: sglang PR #28523 measures a whole GLM decode step "
             "(no HiSparse, mean ITL after 1000 tokens) at 18.15 ms, compute included; the RTX PRO 6000 "
             "validation (PR #33075 batch-1 anchor) implies the overhead given in docs/planner.md.", retime=True),
    Constant("prefetch efficiency", "hardware", "prefetch_efficiency", 0.93, 0.74, 1.0, "", 1.0,
             "sglang PR #29637: IndexShare prefetch hides 70% of HiSparse's host I/O on GLM-5.2, 0.93 of the 75% "
             "our schedule rule allows for 1-in-4 indexer layers; sglang PR #28523: overhead +7.17 ms without and "
             "+3.18 ms with shared-layer overlap (56% hidden, 0.74 of 75%). Upper end: the rule itself.",
             retime=True, relative=False),
    Constant("model FLOP utilisation", "hardware", "mfu", 0.4, 0.25, 0.6, "", 1.0,
             "no source: wide range. Moves prefill (TTFT) and compute-bound steps.", retime=True, relative=False),
    Constant("HBM bandwidth (achieved)", "hardware", "hbm_bytes_per_s", 4.8e12, 3.6e12, 4.8e12, "TB/s", 1e-12,
             "H200 datasheet: 4.8 TB/s peak; the achieved fraction (75-100%) has no source.", retime=True),
    Constant("dense parameters", "model", "dense_params", 17.52e9, 16.57e9, 17.52e9, "B", 1e-9,
             "GLM-5.3's config.json (specs.mla_moe_params: attention 13.06B with IndexShare's 20 indexers, 3 dense "
             "MLP layers, shared experts, LM head; with the card's 744B / 40B within 1%); low end: the LM head "
             "(0.95B) not read at every step.", retime=True),
    Constant("host memory per GPU", "hardware", "host_bytes_per_gpu", 2.0 * 2**40 / 8, 1.8e12 / 8,
             2.0 * 2**40 / 8, "GiB", 1.0 / 2**30,
             "8-GPU servers' host memory over their 8 GPUs: 2 TiB for NVIDIA's H200-SXM-141GBx8 MLCommons inference "
             "v4.1 system (nominal), 1.8 TB for Nebius' B200 node (v6.0; low end). Binds when a rank's host store "
             "holds the instance's histories (tensor-parallel attention at 100K).", retime=False),
    Constant("HiSparse host_to_device_ratio", "admission", "host_to_device_ratio", 8.0, 8.0, 10.0, "", 1.0,
             "SGLang's HiSparse admission budget (admission.py): 8 in the reference 8xH200 PD-colocation command "
             "(LMSYS HiSparse blog, 2026-04-10; nominal), 10 in its PD decode command and in sglang PR #33075.",
             retime=False, relative=False),
    Constant("workspace per GPU", "model", "workspace_bytes", 10e9, 5e9, 20e9, "GB", 1e-9,
             "ASSUMED (activations, CUDA graphs, communication buffers): no source; sets the KV pool.",
             retime=False),
    Constant("draft pass overhead", "drafter", "pass_overhead_s", 0.002, 0.001, 0.005, "ms", 1e3,
             "no source (DFlash2 is one block-drafter forward; ASSUMED).", retime=True),
    Constant("DFlash2 accepted tokens per step, <= 8K context", "speculation", "accept_len_short", 6.0, 2.9, 6.2,
             "tokens", 1.0,
             "block 8 (7 drafts + bonus) on GLM-5.3(-Flash): 6.00 of 8 at 512-8,192 tokens (Blaizzy/mlx-vlm PR #2074, "
             "greedy, batch 1; nominal); 6.2 (74% per draft, tonyd2wild/GLM-5.3-Flash-NVFP4-DFlash2-2x-DGX-Spark "
             "recipe) and 3.45 measured on the same recipe (issue #7: 34-36%); ~3.3 on prose and 2.89 in an agentic "
             "loop (MiaAI-Lab/GLM-5.3-Flash-EXL3-2x-DGX-Sparks issues #142, #73).", retime=False, relative=False),
    Constant("DFlash2 accepted tokens per step, 172K context", "speculation", "accept_len_long", 2.65, 2.1, 3.2,
             "tokens", 1.0,
             "block 8 at long context: 2.1-3.2 at 172K (the figures issue 28 cites; nominal the midpoint); 16% per "
             "draft at 100K+ with k = 7, i.e. 2.1 per step (MiaAI-Lab/GLM-5.3-Flash-EXL3-2x-DGX-Sparks issue #73). "
             "Between 8K and 172K linear in log(context).", retime=False, relative=False),
    Constant("locality overlap", "locality", "overlap", 0.8, 0.6, 0.95, "", 1.0,
             "calibrated: docs/results/calibration.csv (published shares + engine traces); these defaults are "
             "replaced by the fit.", retime=False, relative=False),
    Constant("recent-window fraction", "locality", "recent_fraction", 0.2, 0.05, 0.5, "", 1.0,
             "calibrated with the overlap (same file).", retime=False, relative=False),
)

BY_NAME = {c.name: c for c in CONSTANTS}


@dataclass(frozen=True)
class Setup:
    """Everything a constant can change: hardware, model, drafter, speculation and locality."""

    hw: HardwareSpec
    model: ModelSpec
    drafter: DrafterSpec | None
    speculation: SpeculationModel | None
    locality: LocalityModel
    admission: TokenBudget | None = None

    def current(self, c: Constant) -> float:
        obj = self._obj(c.target)
        if obj is None:
            return c.value
        return float(getattr(obj, c.field))

    def _obj(self, target: str) -> object | None:
        return {"hardware": self.hw, "model": self.model, "drafter": self.drafter, "speculation": self.speculation,
                "locality": self.locality, "admission": self.admission}[target]

    def with_value(self, c: Constant, value: float) -> Setup:
        obj = self._obj(c.target)
        if obj is None:  # e.g. a drafter constant in a run without a drafter: nothing to change
            return self
        cast = type(getattr(obj, c.field))
        return dataclasses.replace(self, **{_attr(c.target): dataclasses.replace(obj, **{c.field: cast(value)})})


def affects(c: Constant, label: str, admission_policies: tuple[str, ...] = ()) -> bool:
    """Whether constant ``c`` can change a ``policy[+drafter]`` run (a policy that does not use the host store
    fetches nothing from it; only speculative runs draft or verify; an admission constant changes the policies
    that follow that rule, ``admission_policies``)."""
    policy, _, drafter = label.partition("+")
    if c.target == "admission":
        return policy in admission_policies
    if c.target == "hardware" and c.field == "host_bytes_per_gpu":
        return policy_named(policy, "config label", KV_POLICIES).uses_host
    if c.target in ("speculation", "drafter"):
        return bool(drafter)
    if c.target == "locality":
        return policy_named(policy, "config label", KV_POLICIES).uses_host
    return True


def _attr(target: str) -> str:
    return {"hardware": "hw"}.get(target, target)


def table_markdown(constants: tuple[Constant, ...] = CONSTANTS) -> str:
    """The constants table (Markdown)."""
    def fmt(c: Constant, v: float) -> str:
        return f"{v * c.scale:.3g}"

    lines = ["| constant | field | value | plausible range | unit | changes | source |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in constants:
        lines.append(f"| {c.name} | `{c.target}.{c.field}` | {fmt(c, c.value)} | {fmt(c, c.low)}–{fmt(c, c.high)} "
                     f"| {c.unit} | {'time only' if c.retime else 'decisions (re-simulated)'} | {c.source} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class ScenarioConstant:
    """A fixed figure of the paper scenario (not varied by the sensitivity): ``value`` and the ``stated`` range
    its sources give (or "–"), ``where`` it lives, ``source`` (or ASSUMED)."""

    name: str
    where: str
    value: str
    stated: str
    unit: str
    source: str


def scenario_constants() -> tuple[ScenarioConstant, ...]:
    """The paper scenario's fixed figures, read from the code that uses them (paper.py, admission.py,
    speculation.py)."""
    budget, dspark, dflash2 = TokenBudget(), ACCEPTANCE["dspark"], ACCEPTANCE["dflash2"]
    blog = "SGLang's reference 8xH200 HiSparse command (LMSYS blog 'HiSparse: Turbocharging Sparse Attention with " \
        "Hierarchical Memory', 2026-04-10)"
    return (
        ScenarioConstant("DSpark accepted tokens per step (block 5)", 'speculation.ACCEPTANCE["dspark"]',
                         f"{dspark.short:g}", "3.2–3.6", "tokens",
                         f"{dspark.source}. Used by the DeepSeek 500K experiments; not varied there."),
        ScenarioConstant("DFlash2 verification block", "paper.PAPER_GAMMA", f"{paper.PAPER_GAMMA + 1} "
                         f"(gamma {paper.PAPER_GAMMA})", "–", "tokens",
                         f"the block the sourced acceptance was measured with (gamma {dflash2.gamma} drafts + the "
                         "bonus token: the DFlash2 rows above)."),
        ScenarioConstant("TokenBudget new_token_ratio", "admission.TokenBudget.new_token_ratio",
                         f"{budget.new_token_ratio:.3g}", "0.098–0.7", "",
                         "SGLang's scheduler (sgl-project/sglang python/sglang/srt/environ.py): "
                         "SGLANG_INIT_NEW_TOKEN_RATIO 0.7 x SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR 0.14 = 0.098, the floor "
                         "it decays to over SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS (600) while decoding runs without "
                         "retraction (0.7 after one); the floor is ASSUMED (steady decoding)."),
        ScenarioConstant("TokenBudget clip_max_new_tokens", "admission.TokenBudget.clip_max_new_tokens",
                         f"{budget.clip_max_new_tokens}", "–", "tokens",
                         "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION, default 4096 (sgl-project/sglang "
                         "python/sglang/srt/managers/env_vars.py; environ.py in later versions)."),
        ScenarioConstant("running requests at most", "paper.PAPER_MAX_RUNNING_REQUESTS",
                         f"{paper.PAPER_MAX_RUNNING_REQUESTS}", "–", "requests",
                         f"--max-running-requests 480 in {blog}."),
        ScenarioConstant("prefill tokens per step", "paper.PAPER_PREFILL_TOKENS_PER_STEP",
                         f"{paper.PAPER_PREFILL_TOKENS_PER_STEP:,}", "–", "tokens",
                         f"--chunked-prefill-size 65536 in {blog}."),
        ScenarioConstant("hot rows per request and layer (B)", "paper.PAPER_HOT_ROWS", f"{paper.PAPER_HOT_ROWS:,}",
                         "–", "rows", f"device_buffer_size 4096 in {blog}."),
        ScenarioConstant("requests per client", "paper.PAPER_REQUESTS_PER_CLIENT",
                         f"{paper.PAPER_REQUESTS_PER_CLIENT}", "–", "requests",
                         "ASSUMED: the paper does not say how many requests its clients send; 2 is the fewest with a "
                         "steady window (metrics.py). One wave instead: docs/results/ablation.md."),
    )


def scenario_markdown(rows: tuple[ScenarioConstant, ...] | None = None) -> str:
    """The scenario's fixed figures (Markdown)."""
    lines = ["| constant | where | value | stated range (not varied) | unit | source |",
             "| --- | --- | --- | --- | --- | --- |"]
    for c in rows if rows is not None else scenario_constants():
        lines.append(f"| {c.name} | `{c.where}` | {c.value} | {c.stated} | {c.unit} | {c.source} |")
    return "\n".join(lines)
