"""trainers: from trajectories to gradient steps.

Planned here: advantage estimators and policy losses as small pure tensor functions, batch packing,
the PyTorch reference trainer, the Megatron-core trainer and weight sync to engines. Imports
`slime_env`, never the reverse.
"""
