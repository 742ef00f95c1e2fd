"""`slime-env serve-engine`: the agents package's subcommand (registered through `slime_env.cli`)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the `slime-env` app."""
    app.command("serve-engine")(serve_engine)


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
                                                            "engines on one CPU host share its cores")) -> None:
    """Serve a local transformers model through SGLang's native HTTP API (/generate, ...)."""
    from agents.engine_server import serve

    if threads:
        import torch

        torch.set_num_threads(threads)
    serve(model=model, host=host, port=port, max_batch_size=max_batch_size, batch_window_s=batch_window_ms / 1000,
          device=device, dtype=dtype)
