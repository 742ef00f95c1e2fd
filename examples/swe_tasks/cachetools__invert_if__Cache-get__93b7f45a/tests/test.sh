#!/bin/bash
# Harbor's verifier for this task (shared mode: it runs in the agent's container, after the agent): restore the
# hidden tests, run the suite, write /logs/verifier/reward.txt. slime_env's own runner does not use this script: its
# reward (slime_env.envs.swe.reward) runs the tests on a clean copy of the repository with the agent's diff applied.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
cd /repo && python3 /tests/grade.py --spec /tests/spec.json --repo /repo --out /logs/verifier
