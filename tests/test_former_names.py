"""One word per idea (step_count, process_group, frequency): the former names still work and warn once."""
import inspect
import warnings

import pytest
import torch

import gradshare
from gradshare import ParallelWrapper, SharedOptimizer, ThresholdState, checkpoint, comm, plan, verify_replicas
from gradshare import costmodel as cm
from gradshare._deprecation import renamed_from
from gradshare.loop import TrainConfig


def _warnings(fn):
    """(value of fn(), the DeprecationWarning messages it raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = fn()
    return value, [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


def test_a_former_attribute_reads_the_new_one_and_warns_once():
    st = ThresholdState()
    value, said = _warnings(lambda: [st.iteration for _ in range(3)])
    assert value == [st.step_count] * 3
    assert said == ["ThresholdState.iteration is deprecated: use ThresholdState.step_count"]


def test_step_count_is_the_one_name_for_steps_shared():
    w = torch.nn.Parameter(torch.zeros(3))
    for obj in (ThresholdState(), SharedOptimizer(torch.optim.SGD([w], lr=0.1)),
                gradshare.ParameterAveraging(torch.nn.Linear(2, 1), torch.optim.SGD([w], lr=0.1))):
        assert obj.step_count == 0, type(obj).__name__


def test_frequency_is_the_one_name_for_steps_between_rounds():
    cfg, said = _warnings(lambda: TrainConfig(model=torch.nn.Linear(2, 2), optimizer=torch.optim.SGD,
                                              train_data="digits", averaging_frequency=3))
    assert cfg.frequency == 3 and said == ["TrainConfig(averaging_frequency=...) is deprecated: use frequency=..."]
    assert _warnings(lambda: cfg.averaging_frequency) == (3, ["TrainConfig.averaging_frequency is deprecated: "
                                                              "use TrainConfig.frequency"])
    pw, said = _warnings(lambda: ParallelWrapper(torch.nn.Linear(2, 2), torch.optim.SGD, workers=1,
                                                 optimizer_kwargs={"lr": 0.1}, averaging_frequency=4))
    assert pw.frequency == 4 and pw.config("digits").frequency == 4 and "frequency=4" in repr(pw)
    assert said == ["ParallelWrapper(averaging_frequency=...) is deprecated: use frequency=..."]
    assert _warnings(lambda: cm.averaging_bytes(2, 1000, period=5))[0] == cm.averaging_bytes(2, 1000, frequency=5)
    old, said = _warnings(lambda: plan.make_plan(10**6, 2, 1e9, 0.1, averaging_period=7))
    assert old["averaging"]["modelled_frequency"] == 7 and len(said) == 1
    assert _warnings(lambda: plan.suggest_averaging_period)[0] is plan.suggest_frequency
    assert _warnings(lambda: plan.MAX_AVERAGING_PERIOD)[0] == plan.MAX_FREQUENCY


def test_process_group_is_the_one_name_for_the_group(tmp_path):
    for fn in (comm.exchange, comm.exchange_async, comm.default_channel, checkpoint.save, verify_replicas):
        assert "process_group" in inspect.signature(fn).parameters, fn.__name__
        assert renamed_from(fn) == {"group": "process_group"}, fn.__name__
    path, said = _warnings(lambda: checkpoint.save(str(tmp_path), 3, {"x": 1}, group=None))   # no group: local
    assert checkpoint.load(path).step == 3
    assert said == ["gradshare.checkpoint.save(group=...) is deprecated: use process_group=..."]
    channel, said = _warnings(lambda: comm.Channel(group=None))
    assert _warnings(lambda: channel.group)[0] is None and channel.process_group is None and len(said) == 1


def test_both_names_at_once_are_refused():
    with pytest.raises(TypeError, match="pass compression= or its former name threshold=, not both"):
        ThresholdState(compression=gradshare.TopK(), threshold=gradshare.Adaptive())
    with pytest.raises(TypeError, match="frequency"):
        TrainConfig(model=torch.nn.Linear(2, 2), optimizer=torch.optim.SGD, train_data="digits", frequency=2,
                    averaging_frequency=3)
