"""The runner: a child of the harness (`slime_env.envs.code.harness`) that loads the solution and makes its calls
(stdlib only; it runs in the solution's sandbox, in the solution's own process).

argv: the file descriptor to report on and the first case to run; stdin: the harness's spec (JSON,
read before any solution code runs, so no file the solution could rewrite is read later). It execs
`solution.py`, then for each call of a case >= start writes one JSON line: `["loaded"]`, then
`["case", c]` before each case's calls and `["call", k, outcome]` after each call, the outcome being
`{"status": "ok", "value", "args_after"?}` or `{"status": "error", "type", "error"}`. The solution can
write the same lines itself: they are observations (return values), never verdicts.
"""

import builtins
import json
import os
import sys

try:
    from _grader_values import NotPlain, tag, untag  # in the sandbox, shipped beside the harness
except ImportError:  # imported on the host (tests, linting)
    from slime_env.envs.code.values import NotPlain, tag, untag


def resolve(namespace, name):
    """The solution's callable for `name`: a top-level function, or `Class().method`."""
    if "()" in name:
        cls_name, _, method = name.partition("()")
        method = method.removeprefix(".")
        cls = namespace.get(cls_name)
        if isinstance(cls, type):
            return getattr(cls(), method, None) if method else cls
        return None
    fn = namespace.get(name)
    if fn is None and isinstance(namespace.get("Solution"), type):  # LeetCode style: class Solution
        fn = getattr(namespace["Solution"](), name, None)
    return fn if callable(fn) else None


def call_outcome(namespace, call, restore):
    """Make one call; what it returned (tagged) or raised. Never raises."""
    try:
        fn = resolve(namespace, call["fn"])
        if fn is None:
            return {"status": "error", "type": "NameError", "error": f"the solution defines no function {call['fn']!r}"}
        args, kwargs = untag(call["args"]), untag(call["kwargs"])
        value = fn(*args, **kwargs)
        restore()
        try:
            outcome = {"status": "ok", "value": tag(value)}
        except NotPlain as e:
            return {"status": "error", "type": "TypeError",
                    "error": f"returned a {type(e.value).__name__}: only plain built-in values can be checked"}
        try:
            after = tag(args)
        except NotPlain:  # it put something else into its arguments: the test sees them as they were
            return outcome
        if after != call["args"]:  # the call changed its arguments in place: the test may look at them
            outcome["args_after"] = after
        return outcome
    except BaseException as e:  # noqa: BLE001 - whatever the solution raises is its outcome
        restore()
        return {"status": "error", "type": type(e).__name__, "error": str(e)[:300]}


def runner(fd, start):
    """Load solution.py, then make the calls of cases >= `start`, one JSON line per event on `fd`."""
    out = os.fdopen(fd, "w", buffering=1)
    spec = json.loads(sys.stdin.read())
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the solution reads an empty stdin for its whole life
    saved = dict(builtins.__dict__)

    def restore():  # a solution that replaced built-ins must not break our own tagging
        if builtins.__dict__ != saved:
            builtins.__dict__.clear()
            builtins.__dict__.update(saved)

    def report(*event):
        out.write(json.dumps(list(event)) + "\n")

    namespace = {"__name__": "solution", "__builtins__": builtins}
    sys.argv = ["solution.py"]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    with open("solution.py") as f:
        source = f.read()
    exec(compile(source, "solution.py", "exec"), namespace)  # noqa: S102 - the sandbox holds it
    restore()
    report("loaded")
    current = None
    for k, call in enumerate(spec["calls"]):
        if call["case"] < start:
            continue
        if call["case"] != current:
            current = call["case"]
            report("case", current)
        report("call", k, call_outcome(namespace, call, restore))



if __name__ == "__main__":
    runner(int(sys.argv[1]), int(sys.argv[2]))
