"""The `slime-env` command line (also `python -m slime_env`). Later issues add subcommands here."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="slime_env: environments and token-exact trajectories for agentic RL of LLMs.")


@app.command("list")
def list_envs() -> None:
    """List the registered env ids, one per line."""
    from slime_env.registry import describe, registry_specs

    for spec in registry_specs():
        typer.echo(f"{spec.id}\t{describe(spec)}")


@app.command()
def demo(episodes: int = typer.Option(4, min=1, help="episodes to run (concurrently)"),
         env_id: str = typer.Option("Calculator-v0", "--env", help="registered env id"),
         seed: int = typer.Option(0, help="seed for tasks and sampling"),
         scripted: bool = typer.Option(False, help="use a scripted policy instead of the model"),
         max_new_tokens: int = typer.Option(96, min=1, help="new tokens per turn"),
         max_turns: int = typer.Option(3, min=1, help="turns per episode")) -> None:
    """Run episodes with the embedded SmolLM2-135M-Instruct; show each token ledger."""
    import asyncio

    from slime_env.demo import run_demo

    policy = tokenizer = None
    if not scripted:
        from agents import TransformersPolicy, load_default_model  # lazy: the core never imports agents

        model, tokenizer = load_default_model()
        policy = TransformersPolicy(model, tokenizer, seed=seed)
    try:
        asyncio.run(run_demo(env_id=env_id, episodes=episodes, seed=seed, policy=policy, tokenizer=tokenizer,
                             max_new_tokens=max_new_tokens, max_turns=max_turns))
    finally:
        if policy is not None:
            policy.close()


@app.command("serve-engine")
def serve_engine(model: str = typer.Option("default", help="'default' (embedded SmolLM2-135M-Instruct) or a "
                                                           "Hugging Face model folder"),
                 host: str = typer.Option("127.0.0.1", help="address to bind"),
                 port: int = typer.Option(30000, help="port (0 picks a free one)"),
                 max_batch_size: int = typer.Option(16, min=1, help="requests generated together"),
                 batch_window_ms: float = typer.Option(
                     20.0, min=0, help="how long to wait to fill a batch (HTTP requests arrive spread out)"),
                 device: str = typer.Option("auto", help="'auto' (CUDA when present), 'cuda', 'cuda:N' or 'cpu'"),
                 dtype: str = typer.Option("auto", help="'auto' (bfloat16 on CUDA, float32 on CPU), 'bfloat16', "
                                                         "'float16' or 'float32'")) -> None:
    """Serve a local transformers model through SGLang's native HTTP API (/generate, ...)."""
    from agents.engine_server import serve

    serve(model=model, host=host, port=port, max_batch_size=max_batch_size, batch_window_s=batch_window_ms / 1000,
          device=device, dtype=dtype)


@app.command("serve-env")
def serve_env(env_id: str = typer.Argument(..., help="registered env id"),
              host: str = typer.Option("127.0.0.1", help="address to bind"),
              port: int = typer.Option(8100, help="port (0 picks a free one)"),
              kwargs: str = typer.Option("{}", help="env kwargs as a JSON object"),
              max_sessions: int = typer.Option(1024, min=1, help="open sessions at most ('at capacity' beyond)"),
              idle_timeout_s: float = typer.Option(600.0, help="close sessions idle this long (0: never)"),
              request_timeout_s: float = typer.Option(300.0, help="longest reset/step before a 504")) -> None:
    """Serve a registered env over HTTP for `slime_env.RemoteEnv` (sessions: create/reset/step/close)."""
    import json

    from slime_env.rollout.env_server import serve

    try:
        env_kwargs = json.loads(kwargs)
    except ValueError as e:
        raise typer.BadParameter(f"--kwargs is not JSON: {e}") from None
    serve(env_id, host=host, port=port, env_kwargs=env_kwargs, max_sessions=max_sessions,
          idle_timeout_s=idle_timeout_s or None, request_timeout_s=request_timeout_s)


def _policy_and_tokenizer(spec: str, tokenizer: str, seed: int):
    """'default' | 'sglang://host:port' | 'openai://host:port/v1?model=NAME' -> (policy, tokenizer)."""
    from urllib.parse import parse_qs, urlsplit

    tok = None
    if tokenizer != "default":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    if spec == "default":
        from agents import TransformersPolicy, load_default_model  # lazy: the core never imports agents

        model, default_tok = load_default_model()
        return TransformersPolicy(model, default_tok, seed=seed), tok or default_tok
    from slime_env.offline_tokenizers import smollm2

    parts = urlsplit(spec)
    if parts.scheme == "sglang":
        from agents import SGLangPolicy

        return SGLangPolicy(f"http://{parts.netloc}"), tok or smollm2()
    if parts.scheme == "openai":
        from agents import OpenAIPolicy

        model = (parse_qs(parts.query).get("model") or [""])[0]
        return OpenAIPolicy(f"http://{parts.netloc}{parts.path}", model), tok or smollm2()
    raise typer.BadParameter(f"--policy {spec!r}: use default, sglang://HOST:PORT or openai://HOST:PORT/v1?model=M")


@app.command()
def rollout(env: str = typer.Option(..., help="registered env id (tasks may override with metadata.env_id)"),
            data: str = typer.Option(..., help="tasks: .jsonl or .parquet"),
            out: str = typer.Option(..., help="output directory (groups.jsonl, manifest.json)"),
            policy: str = typer.Option("default", help="default | sglang://HOST:PORT | openai://HOST:PORT/v1?model=M"),
            tokenizer: str = typer.Option("default", help="'default' (SmolLM2) or a tokenizer folder"),
            n: int = typer.Option(8, min=1, help="samples per prompt (group size)"),
            batch_size: int = typer.Option(16, min=1, help="groups per batch"),
            concurrency: int = typer.Option(64, min=1, help="episodes in flight at most"),
            max_turns: int = typer.Option(4, min=1), max_new_tokens: int = typer.Option(256, min=1),
            temperature: float = typer.Option(1.0, min=0.0),
            dynamic_filter: str = typer.Option(None, "--filter", help="e.g. nonzero_std, or pkg.mod:fn"),
            input_key: str = typer.Option("prompt"), label_key: str = typer.Option("label"),
            metadata_key: str = typer.Option("metadata"),
            resume: bool = typer.Option(False, help="continue the rollout already in --out"),
            parquet: bool = typer.Option(False, help="also write one Parquet file per batch"),
            seed: int = typer.Option(0)) -> None:
    """Run the rollout manager over a dataset and write the trajectories."""
    import asyncio

    from slime_env.renderers import get_renderer
    from slime_env.rollout import RolloutManager, load_tasks

    tasks = load_tasks(data, input_key=input_key, label_key=label_key, metadata_key=metadata_key)
    pol, tok = _policy_and_tokenizer(policy, tokenizer, seed)
    manager = RolloutManager(tasks, env_id=env, policy=pol, renderer=get_renderer(tok),
                             sampling_params={"temperature": temperature}, n_samples_per_prompt=n,
                             max_concurrency=max(concurrency, n), max_turns=max_turns, max_new_tokens=max_new_tokens,
                             dynamic_filter=dynamic_filter, out_dir=out, resume=resume, parquet=parquet,
                             progress=True, seed=seed)

    async def main() -> None:
        try:
            while manager.remaining():
                batch = await manager.generate_batch(min(batch_size, manager.remaining()))
                m = batch.metrics
                statuses = ", ".join(f"{k}={int(m['rollout/status/' + k])}" for k in STATUS_KEYS)
                reward = m.get(f"rollout/reward_mean/{env}", float("nan"))
                typer.echo(f"batch {manager.batches}: {len(batch.groups)} groups ({len(batch.dropped)} dropped), "
                           f"{m['rollout/episodes_per_s']:.1f} episodes/s, {m['rollout/tokens_per_s']:.0f} tokens/s, "
                           f"reward {reward:.3f}, status {statuses}")
                if not batch.groups and not batch.dropped:
                    break
        finally:
            await manager.close()
            if hasattr(pol, "close"):
                result = pol.close()
                if asyncio.iscoroutine(result):
                    await result
        typer.echo(f"wrote {out}/groups.jsonl")

    asyncio.run(main())


STATUS_KEYS = ("completed", "truncated", "aborted", "failed")


@app.command()
def train(config: str = typer.Option(None, help="run config (YAML); default: the embedded demo run "
                                                "(trainers/configs/demo.yaml)"),
          steps: int = typer.Option(None, min=1, help="override the config's steps"),
          run_dir: str = typer.Option(None, help="override the config's run_dir")) -> None:
    """RL training: rollouts -> TorchTrainer -> weight sync -> held-out eval; writes metrics, TensorBoard, curves.png."""
    import asyncio
    from importlib.resources import files

    from slime_env.errors import InvalidInput

    from trainers.train_loop import TrainConfig, train as run_train  # lazy: the core never imports trainers

    path = config or str(files("trainers") / "configs" / "demo.yaml")
    try:
        cfg = TrainConfig.from_yaml(path)
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    if steps:
        cfg.steps = steps
    if run_dir:
        cfg.run_dir = run_dir
    typer.echo(f"training {cfg.env} with {cfg.trainer.get('estimator', 'grpo')} for {cfg.steps} steps -> {cfg.run_dir}")
    summary = asyncio.run(run_train(cfg, log=typer.echo))
    typer.echo(f"held-out accuracy {summary['first_accuracy']:.3f} -> {summary['last_accuracy']:.3f} in "
               f"{summary['elapsed_s']:.0f}s; curves: {summary['curves']}, metrics: {summary['metrics']}")

search_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Search-R1 retrieval (envs.search).")
app.add_typer(search_app, name="search")


@search_app.command("build-index")
def search_build_index(corpus: str = typer.Option(..., help="corpus JSONL: {id, contents} (Search-R1) or {id, title, "
                                                              "text}"),
                       out: str = typer.Option(..., help="index folder to write"),
                       dense: str = typer.Option(None, help="build a dense index with this sentence-transformers "
                                                            "model folder ('default': the offline MiniLM)")) -> None:
    """Build a BM25 (default) or dense retrieval index from a corpus file."""
    from envs.search.corpus import read_corpus
    from envs.search.retrievers import BM25Retriever, DenseRetriever
    from slime_env.errors import InvalidInput

    try:
        passages = list(read_corpus(corpus))
        if dense:
            DenseRetriever.build(passages, out, model=None if dense == "default" else dense, log=typer.echo)
        else:
            BM25Retriever.build(passages, out, log=typer.echo)
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {'dense' if dense else 'bm25'} index of {len(passages)} passages to {out}")


@search_app.command("demo-data")
def search_demo_data(out: str = typer.Option(..., help="folder for corpus.jsonl and questions.jsonl"),
                     questions: int = typer.Option(200, min=1)) -> None:
    """Write the offline demo corpus (Python reference topics, not Wikipedia) and its questions."""
    import json
    from pathlib import Path

    from envs.search.corpus import demo_corpus, demo_questions, write_corpus

    write_corpus(demo_corpus(), Path(out) / "corpus.jsonl")
    with open(Path(out) / "questions.jsonl", "w") as f:
        for row in demo_questions(questions):
            f.write(json.dumps(row) + "\n")
    typer.echo(f"wrote {out}/corpus.jsonl and {out}/questions.jsonl")


@app.command("serve-retriever")
def serve_retriever(index: str = typer.Option(..., help="index folder (slime-env search build-index)"),
                    host: str = typer.Option("127.0.0.1", help="address to bind"),
                    port: int = typer.Option(8000, help="port (0 picks a free one)"),
                    topk: int = typer.Option(3, min=1, help="topk when a request gives none")) -> None:
    """Serve an index with Search-R1's POST /retrieve API."""
    from envs.search.server import serve

    serve(index, host=host, port=port, default_topk=topk)


sandbox_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Sandboxed code execution (tools_sandbox).")
app.add_typer(sandbox_app, name="sandbox")


def _sandbox(backend: str, max_concurrency: int | None):
    from tools_sandbox import auto  # lazy: the core never imports tools_sandbox at import time

    common = {"max_concurrency": max_concurrency} if max_concurrency else {}
    return auto(None if backend == "auto" else backend, shared=False, **common)


@sandbox_app.command("build-image")
def sandbox_build_image(tag: str = typer.Option("slime-env-sandbox:py3", help="image name:tag"),
                        method: str = typer.Option("auto", help="auto | dockerfile | mmdebstrap"),
                        suite: str = typer.Option("bookworm", help="Debian suite for mmdebstrap"),
                        mirror: str = typer.Option(None, help="Debian mirror URL for mmdebstrap")) -> None:
    """Build the local Python sandbox image (Dockerfile if a registry answers, else mmdebstrap + docker import)."""
    from tools_sandbox.image import build_image
    from tools_sandbox.types import SandboxError

    try:
        used = build_image(tag, method=method, suite=suite, mirror=mirror, log=typer.echo)
    except SandboxError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"built {tag} ({used})")


@sandbox_app.command("cleanup")
def sandbox_cleanup(all_owners: bool = typer.Option(False, "--all", help="also containers of live processes")) -> None:
    """Remove sandbox containers left behind by crashed processes."""
    from tools_sandbox import cleanup

    typer.echo(f"removed {cleanup(all_owners=all_owners)} container(s)")


@sandbox_app.command("run")
def sandbox_run(file: str = typer.Argument(..., help="code file to run ('-' reads stdin)"),
                language: str = typer.Option("python"), backend: str = typer.Option("auto"),
                timeout_s: float = typer.Option(10.0), memory_mb: int = typer.Option(512)) -> None:
    """Run one file in the sandbox and print the ExecResult as JSON."""
    import asyncio
    import json
    import sys

    code = sys.stdin.read() if file == "-" else open(file).read()

    async def main():
        sandbox = _sandbox(backend, None)
        try:
            return await sandbox.run(code, language, timeout_s=timeout_s, memory_mb=memory_mb)
        finally:
            await sandbox.close()

    typer.echo(json.dumps(asyncio.run(main()).to_dict(), indent=1))


@app.command("serve-sandbox")
def serve_sandbox(host: str = typer.Option("127.0.0.1", help="address to bind"),
                  port: int = typer.Option(8080, help="port (0 picks a free one)"),
                  backend: str = typer.Option("auto", help="auto | docker | bwrap | process"),
                  max_concurrency: int = typer.Option(None, help="runs executing at once (default: the backend's)"),
                  queue_timeout_s: float = typer.Option(30.0, help="503 after waiting this long for a slot")) -> None:
    """Serve a sandbox with SandboxFusion's POST /run_code API (plus GET /health)."""
    from tools_sandbox.server import serve

    serve(_sandbox(backend, max_concurrency), host=host, port=port, max_concurrency=max_concurrency,
          queue_timeout_s=queue_timeout_s)


def main() -> None:
    app()
