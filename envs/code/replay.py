"""The trusted half of assert-style grading: runs the test code, never the solution (stdlib only).

This file is the main script of a sandbox run that holds no solution code, so its report can be
believed. It executes the test's support code (helpers the prompt defines, e.g. HumanEval's `poly`),
prelude and statements with every solution name (`candidate`, MBPP's function names) bound to a
stub. A stub looks its call up in the `table` of calls the solution's own run made
(`slime_env.envs.code.harness`) and returns the recorded value (plain values only), raises the recorded
exception, or loses the case the way the call was lost (timeout, crash). A call not in the table
returns an "unknown" value on which every operation gives another unknown, so the test runs on and
shows every call it makes whose arguments are known; its statement, and every one after it, is then
`pending`, and the grader makes those calls in the solution's sandbox and replays again. Random
numbers are seeded and hashing is fixed, so each replay makes the same calls.

Input (JSON on stdin): `{"replays": [spec, ...]}`, each replayed in its own forked child; a spec has
`support`, `prelude`, `statements` (`[code, is_case]`), `stubs` (test name ->
solution function), `modules` (names the test uses as `name.attr` without importing them: imported
when they are modules), `table` (`[{"key", "n", "outcome"}]`), `statement_timeout_s`, `timeout_s`, `max_new_calls`.
Output (last line of stdout): `{"replays": [...]}`, per spec `{"cases": [{"status", "error"}], "calls": [{"case", "fn",
"args", "kwargs", "key", "n"}], "error"}`; case status: pass / fail / pending, or the status of a lost call.
"""

import ast
import builtins
import json
import os
import random
import select
import signal
import sys
import time

try:
    from _grader_values import NotPlain, tag, untag  # in the sandbox, shipped beside this script
except ImportError:  # imported on the host (tests, linting)
    from slime_env.envs.code.values import NotPlain, tag, untag


class Pending(BaseException):
    """Stops a statement whose outcome cannot be known yet (the new-call budget or its time ran out)."""


class StatementTimeout(BaseException):
    """A test statement ran past its time limit."""


class Lost(BaseException):
    """A call the solution never finished (timeout, crash, ...): the case gets that status."""

    def __init__(self, status, error):
        super().__init__(error)
        self.status, self.error = status, error


class SolutionExit(BaseException):
    """The solution raised SystemExit or KeyboardInterrupt in a call: the case fails, whatever the test catches."""


class SolutionError(Exception):
    """An exception of a class the solution defined (only its name and message came back)."""


class Unknown:
    """The result of a call not made yet: every operation on it gives another Unknown, truth is True."""

    __slots__ = ()

    def _unknown(self, *args, **kwargs):
        return UNKNOWN

    __getattr__ = __call__ = __getitem__ = _unknown
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _unknown
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __matmul__ = __rmatmul__ = _unknown
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _unknown
    __pow__ = __rpow__ = __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = _unknown
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = __divmod__ = __rdivmod__ = _unknown
    __neg__ = __pos__ = __abs__ = __invert__ = __round__ = __trunc__ = __floor__ = __ceil__ = _unknown

    def __bool__(self):
        return True

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __contains__(self, item):
        return True

    def __hash__(self):
        return 0

    def __index__(self):
        return 0

    __int__ = __index__

    def __float__(self):
        return 0.0

    def __complex__(self):
        return 0j

    def __repr__(self):
        return "<unknown>"

    __str__ = __repr__

    def __format__(self, spec):
        return "<unknown>"


UNKNOWN = Unknown()


def _is_unknown(value):
    return type(value) is Unknown


def _exception(kind, message):
    cls = getattr(builtins, kind, None) if isinstance(kind, str) else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # noqa: BLE001 - an exception class with other constructor arguments
            return SolutionError(f"{kind}: {message}")
    if isinstance(cls, type) and issubclass(cls, BaseException):
        return SolutionExit(f"{kind}: {message}")
    return SolutionError(f"{kind}: {message}")


def _update_in_place(target, value):
    """The test's argument object changed as the solution's call changed it (in-place APIs)."""
    if type(target) is list and type(value) is list:
        target[:] = value
    elif type(target) in (dict, set) and type(value) is type(target):
        target.clear()
        target.update(value)


class Replay:
    def __init__(self, spec):
        self.table = {(e["key"], e["n"]): e["outcome"] for e in spec["table"]}
        self.max_new = spec["max_new_calls"]
        self.seen = {}
        self.new_calls = []
        self.statement = -1
        self.pending = False  # this statement touched a call whose result is not known
        self.tainted = False  # ... or an earlier one did: nothing from here on is a verdict
        self.spoiled = None  # (status, error) of a call that exited or was lost, whatever the test caught

    def assert_failed(self, *message):
        if not (self.pending or self.tainted):
            raise AssertionError(*message)

    def call(self, fn, args, kwargs):
        try:
            targs, tkwargs = tag(list(args)), tag(dict(kwargs))
        except NotPlain as e:
            if _is_unknown(e.value):  # built from a result not known yet: wait for it
                self.pending = True
                return UNKNOWN
            raise TypeError(f"{fn}() was passed a {type(e.value).__name__}: only plain built-in values can be sent "
                            f"to the solution") from None
        key = json.dumps([fn, targs, tkwargs])
        n = self.seen[key] = self.seen.get(key, -1) + 1
        outcome = self.table.get((key, n))
        if outcome is None:
            self.pending = True
            self.new_calls.append({"case": self.statement, "fn": fn, "args": targs, "kwargs": tkwargs,
                                   "key": key, "n": n})
            if len(self.new_calls) >= self.max_new:
                raise Pending()
            return UNKNOWN
        status = outcome.get("status")
        if status == "ok":
            if "args_after" in outcome:
                for target, value in zip(args, untag(outcome["args_after"])):
                    _update_in_place(target, value)
            return untag(outcome["value"])
        if status == "error":
            error = _exception(outcome.get("type"), str(outcome.get("error", "")))
            if isinstance(error, SolutionExit):
                self.spoiled = self.spoiled or ("fail", str(error))
            raise error
        self.spoiled = self.spoiled or (str(status), str(outcome.get("error", "")))
        raise Lost(*self.spoiled)

    def stub(self, fn):
        def solution_function(*args, **kwargs):
            return self.call(fn, args, kwargs)

        solution_function.__name__ = fn
        return solution_function


class _SoftAsserts(ast.NodeTransformer):
    """`assert test, msg` -> `if not test: __replay_assert__(msg)`: while a statement runs on unknown values
    a failing assert must not stop it (a loop would show one call per replay instead of all of them)."""

    def visit_Assert(self, node):
        args = [node.msg] if node.msg is not None else []
        fail = ast.Expr(ast.Call(ast.Name("__replay_assert__", ast.Load()), args, []))
        return ast.copy_location(ast.If(ast.UnaryOp(ast.Not(), node.test), [fail], []), node)


def _compile(code):
    tree = _SoftAsserts().visit(ast.parse(code, "test.py"))
    return compile(ast.fix_missing_locations(tree), "test.py", "exec")


def _on_alarm(signum, frame):
    raise StatementTimeout()


def run(spec):
    replay = Replay(spec)
    namespace = {"__name__": "__main__", "__builtins__": builtins, "__replay_assert__": replay.assert_failed}
    cases = []
    try:
        exec(compile(spec["support"], "prompt.py", "exec"), namespace)  # noqa: S102 - trusted test code
        exec(compile(spec["prelude"], "test_prelude.py", "exec"), namespace)  # noqa: S102
    except BaseException as e:  # noqa: BLE001 - the tests themselves are broken
        return {"cases": [], "calls": [],
                "error": f"the test code fails before any test: {type(e).__name__}: {str(e)[:300]}"}
    for name in spec["modules"]:
        if name not in namespace:
            import importlib

            try:
                namespace[name] = importlib.import_module(name)
            except ImportError:
                pass  # then the solution defines it: a stub below
    for name, fn in spec["stubs"].items():
        if name not in namespace:
            namespace[name] = replay.stub(fn)
    setup_error = None
    signal.signal(signal.SIGALRM, _on_alarm)
    for i, (code, is_case) in enumerate(spec["statements"]):
        if setup_error is not None:
            if is_case:
                cases.append({"status": "fail", "error": setup_error})
            continue
        replay.statement, replay.pending, replay.spoiled = i, False, None
        status, error = "pass", ""
        signal.setitimer(signal.ITIMER_REAL, spec["statement_timeout_s"])
        try:
            exec(_compile(code), namespace)  # noqa: S102
        except Pending:
            replay.pending = True
        except Lost as e:
            status, error = e.status, e.error
        except StatementTimeout:  # while values are unknown it may loop on them: then it is only pending
            status, error = "timeout", f"the test statement ran past {spec['statement_timeout_s']:g}s"
        except BaseException as e:  # noqa: BLE001 - a failing test statement
            status, error = "fail", f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if replay.spoiled is not None:  # caught by the test or not, an exit or a lost call fails the case
            status, error = replay.spoiled
        replay.tainted = replay.tainted or replay.pending  # what follows may depend on values not known yet
        if replay.tainted:
            status, error = "pending", ""
        if is_case:
            cases.append({"status": status, "error": error})
        elif status != "pass":
            setup_error = f"the test setup failed: {error}"
        if len(replay.new_calls) >= replay.max_new:
            break
    cases += [{"status": "pending", "error": ""}] * (sum(c for _, c in spec["statements"]) - len(cases))
    return {"cases": cases, "calls": replay.new_calls, "error": ""}


def replay_in_child(spec):
    """One replay in a forked child (each starts from the same clean state: globals, random seed, alarms)."""
    r_fd, w_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r_fd)
        try:
            random.seed(0)
            data = json.dumps(run(spec)).encode()
        except BaseException as e:  # noqa: BLE001 - reported, never lost
            data = json.dumps({"cases": [], "calls": [], "error": f"the test replay failed: {e!r}"}).encode()
        with os.fdopen(w_fd, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w_fd)
    chunks, deadline = [], time.monotonic() + spec["timeout_s"]
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r_fd], [], [], left)[0]:
            os.kill(pid, signal.SIGKILL)
            chunks = None
            break
        chunk = os.read(r_fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r_fd)
    os.waitpid(pid, 0)
    if chunks is None:
        return {"cases": [], "calls": [], "error": f"the test replay ran past {spec['timeout_s']:g}s"}
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        return {"cases": [], "calls": [], "error": "the test replay ended without a report"}


def main():
    if sys.flags.hash_randomization:  # set order must not change between replays (our sandboxes fix it already)
        os.execve(sys.executable, [sys.executable, "-s", "-u", __file__], {**os.environ, "PYTHONHASHSEED": "0"})
    batch = json.loads(sys.stdin.read())
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    results = [replay_in_child(spec) for spec in batch["replays"]]
    sys.stdout.write("\n" + json.dumps({"replays": results}) + "\n")


if __name__ == "__main__":
    main()
