"""The training run's shape: every kind in the registries keeps its role's contract, the config's sections are parsed
once, the async mode lives in the batch source only, and RolloutManager's options come in groups."""

from __future__ import annotations

import asyncio
import inspect
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")

from slime_env.errors import InvalidInput  # noqa: E402
from slime_env.trainers.run import roles  # noqa: E402


def keeps(obj, role) -> bool:
    """`obj` (an instance, or a class for its methods only) has every method, property and attribute of `role`."""
    members = [n for n, v in vars(role).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))]
    attributes = [] if isinstance(obj, type) else list(getattr(role, "__annotations__", {}))
    cls = obj if isinstance(obj, type) else type(obj)
    return all(hasattr(cls, n) for n in members) and all(n in vars(obj) for n in attributes)


def test_every_registered_kind_keeps_its_roles_contract(tmp_path):
    from slime_env.trainers import weight_sync as ws
    from slime_env.trainers.run.engines import STARTS, EngineConfig, Engines
    from slime_env.trainers.run.sources import SOURCES, AsyncConfig
    from slime_env.trainers.run.trainer_group import (TRAINER_GROUPS, LocalTrainerGroup, ProcessTrainerGroup,
                                                      RayTrainerGroup)

    engines = Engines(EngineConfig(), model_path="m", max_concurrency=4, run_dir=tmp_path, seed=0, device="cpu",
                      dtype="auto")
    assert keeps(engines, roles.Engines) and set(STARTS) == {"embedded", "serve", "sglang", "openai", "vllm"}
    assert all(keeps(group, roles.TrainerGroup) for group in (LocalTrainerGroup, RayTrainerGroup, ProcessTrainerGroup))
    assert set(TRAINER_GROUPS) == {"local", "process", "ray"}
    for channel in (ws.InPlace(None), ws.Frozen(), ws.FromTensor(lambda: []),
                    ws.Distributed(lambda: [], backend="gloo"), ws.FromDisk(lambda: [], folder=tmp_path)):
        assert isinstance(channel, roles.WeightChannel) and keeps(channel, roles.WeightChannel)
    for mode, cls in SOURCES.items():
        assert keeps(cls(AsyncConfig(mode=mode), 2), roles.BatchSource)


def test_the_loop_has_no_branch_on_the_async_mode_and_reads_no_pool():
    import slime_env.trainers.run.loop as loop

    text = Path(loop.__file__).read_text()
    assert not re.search(r"\.mode\b", text) and ".pool" not in text and "asynchrony." not in text
    step = inspect.getsource(loop.train_step)
    assert len(step.splitlines()) <= 80


def test_the_sources_order_their_tasks_and_keep_their_state():
    from slime_env.trainers.run.sources import AsyncConfig, make_source

    tasks = list(range(10))
    off = make_source(AsyncConfig(), 2)
    assert off.tasks(tasks, steps=3, start=0) == list(range(8)) and off.manager_options() == {}
    # a resumed run: the same indices (its seeds), the steps before it skipped
    assert off.tasks(tasks, steps=3, start=1) == list(range(8)) and off.manager_options() == {"skip": [0, 1]}
    assert off.state() is None
    full = make_source(AsyncConfig(mode="full", max_staleness=1, interrupt="resume"), 2)
    assert len(full.tasks(tasks, steps=3, start=1)) == (3 + 1 + 2) * 2
    full.restore({"trained_groups": [0, 3]})
    assert full.manager_options() == {"skip": [0, 3], "partial_rollout": True}
    assert full.state() == {"trained_groups": [0, 3]}


def test_an_async_run_on_a_gpu_puts_its_engine_in_a_process_of_its_own_unless_told(monkeypatch):
    """`engine.kind` left out: embedded, except in an async mode with the trainer on a GPU of this host, where the
    engine is a serve-engine beside it (generation in the trainer's process shares its GIL); a kind the config
    names, a CPU trainer and an opponent pool (which needs the embedded engine) keep theirs; where the trainer runs in
    other processes (a Ray cluster, which places engine servers; cluster.backend process) it is serve."""
    import torch

    from slime_env.trainers.run.config import TrainConfig

    def kind(cuda: bool = True, **raw) -> str:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        return TrainConfig.from_dict(raw).sections.engine.kind

    for mode in ("overlap", "full"):
        assert kind(**{"async": {"mode": mode}}) == "serve"
    assert kind(**{"async": {"mode": "off"}}) == "embedded"
    assert kind(cuda=False, **{"async": {"mode": "full"}}) == "embedded"
    assert kind(**{"async": {"mode": "full"}, "device": "cpu"}) == "embedded"
    assert kind(**{"async": {"mode": "full"}, "engine": {"kind": "embedded"}}) == "embedded"
    assert kind(**{"async": {"mode": "full"}, "engine": {"count": 2}}) == "serve"
    assert kind(cuda=False, **{"cluster": {"backend": "ray"}}) == "serve"  # Ray places engine servers
    assert kind(cuda=False, **{"cluster": {"backend": "process"}}) == "serve"  # the trainer is in other processes
    assert kind(**{"async": {"mode": "full"}, "opponent_pool": {"agents": ["b"], "size": 2}}) == "embedded"


def test_the_config_is_parsed_once_and_errors_name_the_yaml_path():
    from slime_env.trainers.run.config import RunSections, TrainConfig

    cfg = TrainConfig.from_dict({"async": {"mode": "overlap"}, "trainer": {"lr": 1e-5}})
    assert isinstance(cfg.sections, RunSections) and cfg.sections is cfg.sections
    assert cfg.sections.trainer.off_policy == "tis" and cfg.sections.asynchrony.mode == "overlap"
    assert cfg.document() == cfg.__dict__ and cfg.document()["async_"] == {"mode": "overlap"}
    with pytest.raises(InvalidInput, match=r"run\.yaml: engine\.weight_sync: 'ftp' is not"):
        TrainConfig.from_dict({"engine": {"kind": "serve", "weight_sync": "ftp"}}, "run.yaml")
    with pytest.raises(InvalidInput, match=r"run\.yaml: async\.mode: 'later' is not one of"):
        TrainConfig.from_dict({"async": {"mode": "later"}}, "run.yaml")


@pytest.mark.parametrize("raw, where", [
    ({"async": {"mode": "full", "max_staleness": True}}, r"async\.max_staleness: expected an integer, got True"),
    ({"async": {"mode": "full", "in_flight": True}}, r"async\.in_flight: expected an integer, got True"),
    ({"steps": True}, r"run\.yaml: steps: expected an integer, got True"),
    ({"save_every": False}, r"run\.yaml: save_every: expected an integer, got False"),
    ({"keep_last": True}, r"run\.yaml: keep_last: expected an integer, got True"),
    ({"steps": 2.5}, r"run\.yaml: steps: expected an integer, got 2\.5"),
    ({"trainer": {"micro_batch_size": True}}, r"run\.yaml: trainer\.micro_batch_size: expected an integer"),
    ({"trainer": {"lr": "fast"}}, r"run\.yaml: trainer\.lr: expected a number, got 'fast'"),
    ({"engine": {"kind": "serve", "count": True}}, r"run\.yaml: engine\.count: expected an integer"),
    ({"cluster": {"trainer": {"nodes": True}}}, r"run\.yaml: cluster\.trainer\.nodes: expected an integer"),
    ({"warmup": {"steps": True, "data": {"path": "x"}}}, r"run\.yaml: warmup\.steps: expected an integer"),
    ({"eval": {"every": True, "sets": {}}}, r"run\.yaml: eval\.every: expected an integer"),
    ({"eval": {"sets": {"a": {"data": {}, "n_samples": True}}}}, r"run\.yaml: eval\.sets\.a\.n_samples: expected"),
    ({"opponent_pool": {"agents": ["b"], "size": True}}, r"run\.yaml: opponent_pool\.size: expected an integer"),
])
def test_booleans_are_no_integers_in_any_section(raw, where):
    """YAML's `true` is Python's 1: an integer field refuses it (and a float, and a word), naming its YAML path."""
    from slime_env.trainers.run.config import TrainConfig

    with pytest.raises(InvalidInput, match=where):
        TrainConfig.from_dict(raw, "run.yaml")


def test_a_float_field_takes_an_integer_and_yaml_1_1_exponents():
    from slime_env.trainers.run.config import TrainConfig

    cfg = TrainConfig.from_dict({"trainer": {"lr": "1e-5", "max_grad_norm": 2}, "temperature": 1})
    assert cfg.sections.trainer.lr == 1e-5 and cfg.sections.trainer.max_grad_norm == 2


def test_rollout_manager_options_come_in_groups_or_one_by_one(smollm2_tok):
    from slime_env import RolloutManager, ScriptedPolicy, get_renderer
    from slime_env.rollout import EpisodeOptions, GroupOptions

    common = {"env_id": "Calculator-v0", "policy": ScriptedPolicy(smollm2_tok, lambda _: "4"),
              "renderer": get_renderer(smollm2_tok)}
    grouped = RolloutManager(["2+2?"], **common, episode=EpisodeOptions(max_turns=3),
                             groups=GroupOptions(n_samples_per_prompt=2, max_concurrency=4))
    flat = RolloutManager(["2+2?"], **common, max_turns=3, n_samples_per_prompt=2, max_concurrency=4)
    assert grouped.options == flat.options and grouped.episode_kwargs["max_turns"] == 3 and grouped.n == 2
    with pytest.raises(TypeError, match=r"\['max_turns'\] given both as keywords and in episode="):
        RolloutManager(["2+2?"], **common, episode=EpisodeOptions(), max_turns=2)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['max_turn'\]"):
        RolloutManager(["2+2?"], **common, max_turn=2)
    for m in (grouped, flat):
        asyncio.run(m.close())
