"""Integrations with other RL frameworks: `slime_env.integrations.slime` (THUDM/slime's plug-in points)."""
