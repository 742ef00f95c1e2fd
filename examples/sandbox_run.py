"""Run untrusted code in the strongest sandbox this machine offers, then show what the limits do.

    python examples/sandbox_run.py
"""

import asyncio

from slime_env import tools_sandbox


async def main() -> None:
    sandbox = tools_sandbox.auto()
    print("using:", sandbox.describe(), *getattr(sandbox, "auto_notes", []), sep="\n  ")
    try:
        cases = {
            "ok": ("import sys, helper\nprint(helper.double(int(sys.stdin.read())))", {"stdin": "21"}),
            "error": ("raise ValueError('bad input')", {}),
            "timeout": ("while True: pass", {"timeout_s": 1}),
            "memory": ("x = bytearray(2 << 30)", {"memory_mb": 128}),
            "output_limit": ("print('y' * 10_000_000)", {"output_limit_bytes": 4096}),
        }
        files = {"helper.py": "def double(x):\n    return 2 * x\n"}
        results = await asyncio.gather(*(sandbox.run(code, files=files, **kw) for code, kw in cases.values()))
        for name, r in zip(cases, results):
            print(f"{name:13s} -> {r.status:13s} exit={r.exit_code} {r.duration_s * 1000:6.1f} ms "
                  f"{(r.stdout.strip() or r.reason or r.stderr.strip().splitlines()[-1])[:60]}")
    finally:
        await sandbox.close()


if __name__ == "__main__":
    asyncio.run(main())
