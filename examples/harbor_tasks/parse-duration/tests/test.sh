#!/bin/bash
# Named rewards in reward.json, one per test file (pytest run from /tests only, as in the other tasks).
cd /tests || exit 1
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
correctness=0
python3 -I -m pytest -q -p no:cacheprovider -c /dev/null --rootdir=/tests --confcutdir=/tests test_correctness.py && correctness=1
errors=0
python3 -I -m pytest -q -p no:cacheprovider -c /dev/null --rootdir=/tests --confcutdir=/tests test_errors.py && errors=1
echo "{\"correctness\": $correctness, \"errors\": $errors}" > /logs/verifier/reward.json
