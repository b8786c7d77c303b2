"""Renamed public names keep working for a release, with a FutureWarning naming the new one."""

import importlib
import warnings

import pytest

# (module, old name, new name)
RENAMED = [
    ("commlab.pipeline", "PipelineSchedule", "PipelineExecutor"),
    ("commlab.pipeline", "Stage", "RankStages"),
    ("commlab.pipeline", "validate", "check_schedule"),  # "validate": the model against measurement
    ("commlab.pipeline.runtime.executor", "PipelineSchedule", "PipelineExecutor"),
    ("commlab.pipeline.runtime.stages", "Stage", "RankStages"),
    # "profile" is what a workload's compute measured; the cached terms of a machine are a calibration
    ("commlab.costmodel.calibration.driver", "DEFAULT_PROFILE", "DEFAULT_CALIBRATION"),
    ("commlab.costmodel.calibration.driver", "profile_for", "calibration_for"),
    ("commlab.costmodel.calibration.cache", "ProfileError", "CalibrationError"),
    ("commlab.costmodel.calibration.cache", "StaleProfile", "StaleCalibration"),
    ("commlab.costmodel.hardware.presets", "flops_profile", "compute_from_flops"),
]


@pytest.mark.parametrize("module, old, new", RENAMED)
def test_an_old_name_warns_and_is_the_new_one(module, old, new):
    mod = importlib.import_module(module)
    with pytest.warns(FutureWarning, match=rf"{module}\.{old} is deprecated .* use {module}\.{new}$"):
        value = getattr(mod, old)
    assert value is getattr(mod, new)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name is silent
        getattr(mod, new)
    assert old not in getattr(mod, "__all__", ())  # `import *` takes the new names only


def test_the_warning_points_at_the_caller_and_unknown_names_still_fail():
    with pytest.warns(FutureWarning) as caught:
        from commlab.pipeline import PipelineSchedule  # noqa: F401
    assert caught[0].filename == __file__
    import commlab.pipeline

    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        commlab.pipeline.Nope  # noqa: B018
