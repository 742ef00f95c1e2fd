"""`slime-env search build-index | demo-data` and `slime-env serve-retriever` (registered through
`slime_env.cli`)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the `slime-env` app."""
    app.add_typer(search_app, name="search")
    app.command("serve-retriever")(serve_retriever)


search_app = typer.Typer(add_completion=False, no_args_is_help=True,
                         help="Search-R1 retrieval (slime_env.envs.search).")


@search_app.command("build-index")
def search_build_index(corpus: str = typer.Option(..., help="corpus JSONL: {id, contents} (Search-R1) or {id, title, "
                                                              "text}"),
                       out: str = typer.Option(..., help="index folder to write"),
                       dense: str = typer.Option(None, help="build a dense index with this sentence-transformers "
                                                            "model folder ('default': the offline MiniLM)")) -> None:
    """Build a BM25 (default) or dense retrieval index from a corpus file."""
    from slime_env.envs.search.corpus import read_corpus
    from slime_env.envs.search.retrievers import BM25Retriever, DenseRetriever

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

    from slime_env.envs.search.corpus import demo_corpus, demo_questions, write_corpus

    write_corpus(demo_corpus(), Path(out) / "corpus.jsonl")
    with open(Path(out) / "questions.jsonl", "w") as f:
        for row in demo_questions(questions):
            f.write(json.dumps(row) + "\n")
    typer.echo(f"wrote {out}/corpus.jsonl and {out}/questions.jsonl")


def serve_retriever(index: str = typer.Option(..., help="index folder (slime-env search build-index)"),
                    host: str = typer.Option("127.0.0.1", help="address to bind"),
                    port: int = typer.Option(8000, help="port (0 picks a free one)"),
                    topk: int = typer.Option(3, min=1, help="topk when a request gives none")) -> None:
    """Serve an index with Search-R1's POST /retrieve API."""
    from slime_env.envs.search.server import serve

    serve(index, host=host, port=port, default_topk=topk)
