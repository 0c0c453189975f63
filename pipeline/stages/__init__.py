"""The stages, in run order. Each is one module with the same small interface (stages.base.Stage)."""
from pipeline.stages.build_target import BuildTarget
from pipeline.stages.deploy_measure import DeployMeasure
from pipeline.stages.evaluate_offline import EvaluateOffline
from pipeline.stages.extract import Extract
from pipeline.stages.handover import Handover
from pipeline.stages.measure_existing import MeasureExisting
from pipeline.stages.measure_production import MeasureProduction
from pipeline.stages.pick_checkpoint import PickCheckpoint
from pipeline.stages.preflight import Preflight
from pipeline.stages.prepare import Prepare
from pipeline.stages.regenerate import Regenerate
from pipeline.stages.train import Train
from pipeline.stages.vocab import Vocab

STAGES = [Preflight(), BuildTarget(), MeasureProduction(), MeasureExisting(), Regenerate(), Prepare(), Extract(),
          Vocab(), Train(), PickCheckpoint(), EvaluateOffline(), DeployMeasure(), Handover()]


def stage_names() -> list[str]:
    return [s.name for s in STAGES]
