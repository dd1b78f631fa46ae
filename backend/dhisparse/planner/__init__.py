"""Capacity planner: a step-level simulation of one decode GPU whose KV decisions are made by ``dhisparse.kv``.

See docs/planner.md. Entry points: :func:`simulate`, :class:`Simulator`, the ``dhisparse-plan`` CLI.
"""

from dhisparse.planner.locality import LocalityModel
from dhisparse.planner.scale import ScaleSpec
from dhisparse.planner.simulator import SimResult, Simulator, simulate
from dhisparse.planner.specs import DRAFTERS, HARDWARE_PRESETS, MODEL_PRESETS, DrafterSpec, HardwareSpec, ModelSpec
from dhisparse.planner.speculation import SpeculationModel
from dhisparse.planner.workload import ServingSpec, WorkloadSpec

__all__ = ["DRAFTERS", "HARDWARE_PRESETS", "MODEL_PRESETS", "DrafterSpec", "HardwareSpec", "LocalityModel",
           "ModelSpec", "ScaleSpec", "ServingSpec", "SimResult", "Simulator", "SpeculationModel", "WorkloadSpec",
           "simulate"]
