"""Capacity planner: a step-level simulation of one decode GPU whose KV decisions are made by ``dhisparse.kv``.

See docs/planner.md. Entry points: :func:`simulate`, :class:`Simulator`, the ``dhisparse-plan`` CLI.
"""

from dhisparse_planner.locality import LocalityModel
from dhisparse_planner.scale import ScaleSpec
from dhisparse_planner.simulator import SimResult, Simulator, simulate
from dhisparse_planner.specs import DRAFTERS, HARDWARE_PRESETS, MODEL_PRESETS, DrafterSpec, HardwareSpec, ModelSpec
from dhisparse_planner.speculation import SpeculationModel
from dhisparse_planner.workload import ServingSpec, WorkloadSpec

__all__ = ["DRAFTERS", "HARDWARE_PRESETS", "MODEL_PRESETS", "DrafterSpec", "HardwareSpec", "LocalityModel",
           "ModelSpec", "ScaleSpec", "ServingSpec", "SimResult", "Simulator", "SpeculationModel", "WorkloadSpec",
           "simulate"]
