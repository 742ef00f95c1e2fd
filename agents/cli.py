"""`slime-env serve-engine` and `slime-env serve-gateway`: the agents package's subcommands (registered through
`slime_env.cli`)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the `slime-env` app."""
    app.command("serve-engine")(serve_engine)
    app.command("serve-gateway")(serve_gateway)


def serve_engine(model: str = typer.Option("default", help="'default' (embedded SmolLM2-135M-Instruct) or a "
                                                           "Hugging Face model folder"),
                 host: str = typer.Option("127.0.0.1", help="address to bind"),
                 port: int = typer.Option(30000, help="port (0 picks a free one)"),
                 max_batch_size: int = typer.Option(16, min=1, help="requests generated together"),
                 batch_window_ms: float = typer.Option(
                     20.0, min=0, help="how long to wait to fill a batch (HTTP requests arrive spread out)"),
                 device: str = typer.Option("auto", help="'auto' (CUDA when present), 'cuda', 'cuda:N' or 'cpu'"),
                 dtype: str = typer.Option("auto", help="'auto' (bfloat16 on CUDA, float32 on CPU), 'bfloat16', "
                                                         "'float16' or 'float32'"),
                 threads: int = typer.Option(0, min=0, help="CPU threads for torch (0: torch's default); several "
                                                            "engines on one CPU host share its cores"),
                 mem_fraction: float = typer.Option(
                     None, help="the fraction of the GPU's free memory the paged engine's K/V pool takes, in (0, 1) "
                                "(default: the embedded engine's 0.4, which leaves room for a trainer on the same "
                                "GPU; a GPU of its own can give more, e.g. 0.85)"),
                 parser: str = typer.Option("hermes", help="the model family's tool-call parser, for the OpenAI "
                                                           "chat route's tool_calls")) -> None:
    """Serve a local transformers model through SGLang's native HTTP API (/generate, ...) and, as SGLang does,
    OpenAI's /v1/chat/completions (streamed or not), /v1/completions and /v1/models (no ledger recorded: put
    serve-gateway in front for per-session token ledgers)."""
    from slime_env.agents.engine_server import serve

    if mem_fraction is not None and not 0 < mem_fraction < 1:
        raise typer.BadParameter(f"must be in (0, 1), got {mem_fraction}", param_hint="'--mem-fraction'")
    if threads:
        import torch

        torch.set_num_threads(threads)
    serve(model=model, host=host, port=port, max_batch_size=max_batch_size, batch_window_s=batch_window_ms / 1000,
          device=device, dtype=dtype, mem_fraction=mem_fraction, parser=parser)


def serve_gateway(engine: str = typer.Option(..., help="the engine's URL: an SGLang server or router (/generate), or "
                                                       "`slime-env serve-engine`"),
                  model: str = typer.Option("default", help="tokenizer and chat template: 'default' (SmolLM2-135M-"
                                                            "Instruct) or the served model's Hugging Face folder"),
                  parser: str = typer.Option("hermes", help="the model family's tool-call parser"),
                  host: str = typer.Option("127.0.0.1", help="address to bind (loopback unless you mean otherwise)"),
                  port: int = typer.Option(8000, help="port (0 picks a free one)"),
                  strict: bool = typer.Option(True, help="check every rendered bridge against a full render"),
                  max_new_tokens: int = typer.Option(1024, min=1),
                  max_context_tokens: int = typer.Option(0, min=0, help="0: no limit"),
                  session_ttl_s: float = typer.Option(3600.0, min=1.0),
                  max_body_bytes: int = typer.Option(4 << 20, min=1024, help="larger request bodies get 413 (an "
                                                                            "agent's whole context is in each body)")
                  ) -> None:
    """Serve the agent gateway: per-session OpenAI (/v1/chat/completions) and Anthropic (/v1/messages) routes in
    front of an engine, recording exact token ledgers. Sessions are opened and closed over /admin/sessions with the
    admin key (SLIME_ENV_GATEWAY_ADMIN_KEY, else a random one printed at start); see docs/gateway.md."""
    import asyncio
    import os
    import secrets

    from slime_env.agents.default_model import default_model_path
    from slime_env.clients.sglang import SGLangPolicy
    from slime_env.gateway import Gateway
    from slime_env.renderers import get_renderer

    from transformers import AutoTokenizer

    path = str(default_model_path()) if model == "default" else model
    tokenizer = AutoTokenizer.from_pretrained(path)
    admin = os.environ.get("SLIME_ENV_GATEWAY_ADMIN_KEY") or secrets.token_urlsafe(32)

    async def main() -> None:
        gw = Gateway(SGLangPolicy(engine), get_renderer(tokenizer, strict=strict), parser, strict=strict,
                     max_new_tokens=max_new_tokens, max_context_tokens=max_context_tokens or None,
                     session_ttl_s=session_ttl_s, max_body_bytes=max_body_bytes)
        gw.admin_key = admin
        url = await gw.start(host, port)
        shown = "(from SLIME_ENV_GATEWAY_ADMIN_KEY)" if os.environ.get("SLIME_ENV_GATEWAY_ADMIN_KEY") else admin
        print(f"gateway on {url} in front of {engine}; admin key {shown}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
