"""What a run checks before anything heavy starts (its run folder written, a model loaded, an engine, a rank or a
container started): that the model, the env and its kwargs exist and fit together, and that the trainer and its
colocated engines fit each GPU (`gpu_memory.check_fit`). Each problem is an
`InvalidInput` naming the config field, so a typo costs a second, not a model load and a 70-line traceback."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from slime_env.errors import InvalidInput, RegistryError

if TYPE_CHECKING:
    from slime_env.trainers.run.config import TrainConfig


def check_before_start(cfg: TrainConfig) -> None:
    """`cfg` (a `TrainConfig`): its `model`, its `env` with `env_kwargs` and every eval set's, the module names of
    `trainer.lora` against the model's layers, and on CUDA the GPU memory it needs; InvalidInput naming the field."""
    check_model(cfg.model, "model")
    check_env(cfg.env, cfg.env_kwargs, "env")
    for s in cfg.sections.eval_sets:
        if s.env is not None or s.env_kwargs is not None:
            check_env(s.env or cfg.env, cfg.env_kwargs if s.env_kwargs is None else s.env_kwargs,
                      f"eval.sets.{s.name}.env")
    # last: it builds the model's module tree on the meta device (no weights, well under a second)
    from slime_env.trainers.lora import check_target_modules

    check_target_modules(cfg.sections.trainer.lora, cfg.model)
    # on CUDA: the trainer and the engines on its GPUs fit each GPU (the model's config on the meta device again)
    from slime_env.trainers.run.gpu_memory import check_fit

    check_fit(cfg)


def check_model(model: str, where: str) -> None:
    """`model` is "default", "smolvlm" (the stitched SmolVLM, built offline), a model folder (config.json, or
    safetensors weights), or a Hugging Face repo id ("org/name", left to transformers and its cache); InvalidInput
    naming `where` otherwise."""
    if model in ("default", "smolvlm"):
        return
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not any(path.glob("*.safetensors")):
            raise InvalidInput(f"{where}: {model} is a folder without config.json or .safetensors weights (not a "
                               "Hugging Face model folder)")
        return
    if path.exists():
        raise InvalidInput(f"{where}: {model} is a file; give the model's folder")
    # "org/name" may be a repo id; anything else that names no existing path is a typo of one
    repo_id = model.count("/") == 1 and not model.startswith(("/", ".", "~")) and not model.endswith("/")
    if not repo_id:
        raise InvalidInput(f"{where}: no model folder at {model} ('default', a local model folder, or a Hugging "
                           "Face repo id 'org/name')")


def check_env(env: str, env_kwargs: dict[str, Any], where: str) -> None:
    """The env id (or import path) resolves, its factory loads, and `env_kwargs` fit its signature; nothing is
    built (building may start containers). InvalidInput naming `where` or `where_kwargs`."""
    import inspect

    from slime_env import registry
    from slime_env.loading import load_object

    try:
        spec = registry.spec(env)
    except RegistryError as e:
        raise InvalidInput(f"{where}: {e}") from None
    if not isinstance(spec.entry_point, str):
        factory = spec.entry_point
    else:
        try:
            factory = load_object(spec.entry_point)
        except InvalidInput as e:
            raise InvalidInput(f"{where}: {e}") from None
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or a C callable: nothing to check against
        return
    try:
        signature.bind(**{**spec.kwargs, **env_kwargs})
    except TypeError as e:
        accepted = [p.name for p in signature.parameters.values()
                    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise InvalidInput(f"{where}_kwargs: {env!r} {e} (it takes "
                           f"{accepted})") from None
