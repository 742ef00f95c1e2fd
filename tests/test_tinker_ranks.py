"""`slime-env serve-tinker` over two ranks (torchrun, gloo on CPU): the real `tinker` SDK drives rank 0's server, every
rank runs each training call (`trainers/tinker/ranks.py`); the losses, gradient norm and adapter are the one-process
trainer's, a saved state comes back, and stopping the server ends every rank."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

tinker = pytest.importorskip("tinker")
pytest.importorskip("peft")
psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[1]
MODEL = "Qwen/Qwen3-8B"
# eps 1e-5, not 1e-8: Adam moves an entry whose gradient cancels to near zero by lr * (rounding noise) / eps, and the
# ranks round in another order than one process (TP's partial sums: LoRA A entries 3e-5 apart at eps 1e-6, 3e-6 at 1e-5)
ADAM = {"learning_rate": 1e-2, "beta1": 0.8, "beta2": 0.9, "eps": 1e-5, "weight_decay": 0.1, "grad_clip_norm": 0.05}


def _torchrun(tmp_path: Path, checkpoint: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """`torchrun --nproc-per-node 2 -m slime_env serve-tinker ...` on `checkpoint`; (process, rank 0's URL)."""
    cmd = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "slime_env", "serve-tinker", "--model", MODEL, "--checkpoint", str(checkpoint), "--tokenizer", "qwen3",
           "--port", "0", "--root", str(tmp_path / "ckpt"), "--max-context-length", "256", *args]
    # the ranks run from tmp_path with the safe path (-P's variable): the repository root never shadows packages
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1", "TINKER_API_KEY": "tml-local",
           "TMPDIR": str(tmp_path)}  # torchrun's torchelastic_* folders go with the test
    # a session of its own: a failing test kills the whole group (torchrun cannot pass a SIGKILL on to its ranks)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    seen = []
    while True:
        try:
            line = lines.get(timeout=120)
        except queue.Empty:
            _kill(proc)
            raise AssertionError("no server after 120 s:\n" + "".join(seen)) from None
        seen.append(line)
        if "serving the Tinker API" in line:
            proc.log = seen  # what the ranks printed, for a failing assertion
            threading.Thread(target=lambda: [seen.append(x) for x in iter(lines.get, None)], daemon=True).start()
            return proc, line.split(" at ")[1].split()[0]


def _kill(proc: subprocess.Popen) -> None:
    """torchrun and every rank it started, at once (whatever of them is still there)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _stop(proc: subprocess.Popen, sig: int = signal.SIGINT) -> int:
    """`sig` to rank 0 alone (Ctrl-C: as a user stops the server); every rank must end; torchrun's exit code."""
    rank0 = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == "0"]
    assert len(rank0) == 1
    rank0[0].send_signal(sig)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise AssertionError("the ranks did not end within 60 s of stopping the server") from None


def _datum(ids, **inputs):
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], **inputs})


@pytest.mark.parametrize("backend,tp", [("fsdp", 1), ("megatron", 1), ("megatron", 2)])
def test_two_ranks_give_the_one_process_step_and_stop_together(backend, tp, tmp_path):
    """fsdp over 2 ranks, megatron DP=2 and TP=2, against the same trainer in one process from the same seed: two
    accumulating forward_backward calls, an optim_step with every Adam parameter (clipping acting), a second step:
    same losses, gradient norm and sampler adapter; a state saved over both ranks comes back as a client computing the
    same forward; the sampler (rank 0's engine) samples the adapter; Ctrl-C on rank 0 ends both ranks with 0."""
    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="megatron-core is not installed")
        from slime_env.trainers.megatron_trainer import MegatronTrainer as Trainer
    else:
        from slime_env.trainers.fsdp_trainer import FSDPTrainer as Trainer
    from slime_env.agents.lora_adapter import LoRAAdapter
    from slime_env.trainers.split_step import AdamParams, Datum
    from slime_env.trainers.tinker.backend import ATTN, LORA_ALPHA, MLP
    from slime_env.trainers.tinker.losses import loss_for
    from slime_env.trainers.tinker.models import load_model, load_tokenizer
    from slime_env.trainers.torch_trainer import TrainerConfig

    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    tok = load_tokenizer("qwen3")
    a, b = tok.encode("one step over two ranks"), tok.encode("and the same step, in one process")
    wa = [1.0, 0.5] + [1.0] * (len(a) - 3)
    qb, adv = [-11.0] * (len(b) - 1), [0.5, -1.0] + [0.25] * (len(b) - 3)
    # the tiny random model with its vocabulary padded to a multiple of 8 (megatron's TP splits the vocabulary)
    base = load_model("random", tok)
    base.resize_token_embeddings(len(tok), pad_to_multiple_of=8)
    base.save_pretrained(tmp_path / "model")
    proc, url = _torchrun(tmp_path, tmp_path / "model", "--backend", backend, "--tp", str(tp))
    try:
        service = tinker.ServiceClient(base_url=url)
        client = service.create_lora_training_client(base_model=MODEL, rank=4, seed=11).result()
        got = [client.forward_backward([_datum(a, weights=wa)], "cross_entropy").result().metrics["loss:sum"],
               client.forward_backward([_datum(b, logprobs=qb, advantages=adv)], "ppo").result().metrics["loss:sum"]]
        norm = client.optim_step(tinker.AdamParams(**ADAM)).result().metrics["grad_norm"]
        got.append(client.forward_backward([_datum(a, weights=wa)], "cross_entropy").result().metrics["loss:sum"])
        client.optim_step(tinker.AdamParams(**ADAM)).result()
        path = client.save_weights_for_sampler("two-ranks").result().path
        sampler = service.create_sampling_client(model_path=path).result()  # rank 0's engine, the adapter pushed to it
        assert len(sampler.sample(tinker.ModelInput.from_ints(a[:4]), 1, tinker.SamplingParams(max_tokens=3, seed=1))
                   .result().sequences[0].tokens) == 3
        state = client.save_state("two-ranks").result().path
        restored = service.create_training_client_from_state_with_optimizer(state).result()
        assert restored.forward([_datum(a, weights=wa)], "cross_entropy").result().metrics["loss:sum"] == \
            pytest.approx(client.forward([_datum(a, weights=wa)], "cross_entropy").result().metrics["loss:sum"],
                          rel=1e-5)
    except BaseException:
        _kill(proc)
        print("".join(proc.log))
        raise
    assert _stop(proc) == 0, "".join(proc.log)[-3000:]

    torch.manual_seed(11)  # then the adapter's, as create_lora_training_client(seed=11) sets it
    lora = {"rank": 4, "alpha": LORA_ALPHA, "target_modules": list(ATTN + MLP)}
    direct = Trainer(base, TrainerConfig(backend=backend, lora=lora),
                     pad_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

    def datum(ids, **inputs):
        t = torch.tensor(ids)
        return Datum(t[:-1], t[1:], {k: torch.tensor(v) for k, v in inputs.items()})

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run (OMP_NUM_THREADS=1): the same summation order in the matmuls
    want = [direct.forward_backward([datum(a, weights=wa)], loss_for("cross_entropy", {})[0])[1],
            direct.forward_backward([datum(b, logprobs=qb, advantages=adv)], loss_for("ppo", {})[0])[1]]
    want_norm = direct.optim_step(AdamParams(**ADAM))["grad_norm"]
    want.append(direct.forward_backward([datum(a, weights=wa)], loss_for("cross_entropy", {})[0])[1])
    direct.optim_step(AdamParams(**ADAM))
    torch.set_num_threads(threads)
    assert got == pytest.approx(want, rel=1e-5) and norm == pytest.approx(want_norm, rel=1e-5)
    assert norm > ADAM["grad_clip_norm"]  # the clipping acted
    model_id, _, name = path.removeprefix("tinker://").split("/")
    served = LoRAAdapter.load(tmp_path / "ckpt" / model_id / "sampler_weights" / name).tensors
    expected = direct.adapter().tensors
    assert served.keys() == expected.keys()
    # within a hundredth of one Adam step (lr): TP's other summation order moved an element whose gradient is near
    # Adam's eps by 1.4e-5 in a loaded run; a wrong or missing gradient moves elements by a whole step
    step = ADAM["learning_rate"]
    for k in expected:
        torch.testing.assert_close(served[k], expected[k], rtol=1e-5, atol=step / 100, msg=lambda m: f"{k}: {m}")


def test_a_dead_rank_0_ends_the_other_ranks(tmp_path):
    """Rank 0 killed (no shutdown record sent) while rank 1 waits for the next call: the job ends, failed, instead
    of rank 1 waiting for a week."""
    from slime_env.trainers.tinker.models import load_model, load_tokenizer

    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    tok = load_tokenizer("qwen3")
    load_model("random", tok).save_pretrained(tmp_path / "model")
    proc, url = _torchrun(tmp_path, tmp_path / "model", "--backend", "fsdp")
    tinker.ServiceClient(base_url=url).create_lora_training_client(base_model=MODEL, rank=4).result()
    assert _stop(proc, signal.SIGKILL) != 0


def test_pipeline_parallel_and_torch_over_ranks_are_refused_by_name(tmp_path, monkeypatch):
    """What serve-tinker does not run over several ranks is refused before any weight loads, saying what is."""
    from typer.testing import CliRunner

    import typer

    from slime_env.trainers.cli import register

    app = typer.Typer()
    register(app)
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets
    for args, message in [(["--backend", "megatron", "--pp", "2"], "--pp 2: Megatron's pipeline schedule owns"),
                          (["--backend", "torch"], "--backend torch over 2 ranks"),
                          (["--backend", "fsdp", "--tp", "2"], "--tp 2 with --backend fsdp over 2 ranks"),
                          (["--backend", "megatron", "--tp", "4"], "TP must divide the ranks")]:
        result = CliRunner().invoke(app, ["serve-tinker", "--model", MODEL, "--root", str(tmp_path), *args])
        assert result.exit_code == 1 and message in result.output, result.output
        assert "fsdp on any number of ranks, megatron with DP x TP" in result.output
