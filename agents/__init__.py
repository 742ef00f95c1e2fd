"""agents: policies that talk to models.

Planned here: the SGLang native client (with router session affinity), an OpenAI-compatible client,
a local transformers engine and a server that speaks SGLang's `/generate`, and multi-agent
orchestration. Every policy implements `slime_env.Policy`. Imports `slime_env`, never the reverse.
"""
