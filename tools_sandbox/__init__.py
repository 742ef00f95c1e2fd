"""tools_sandbox: sandboxed execution of untrusted model output.

Planned here: a Docker warm pool, bubblewrap and plain-process backends behind one async
`run(...)` interface with hard limits, and a SandboxFusion-compatible HTTP server. May import
`slime_env`; `slime_env` never imports it.
"""
