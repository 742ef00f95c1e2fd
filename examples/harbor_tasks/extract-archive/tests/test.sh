#!/bin/bash
# Runs the tests from /tests only: python3 -I (no user site, no PYTHON* variables, no cwd on sys.path), no ini
# file (-c /dev/null), conftest.py files only under /tests, no plugin autoloading; 1 or 0 in reward.txt.
cd /tests || exit 1
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
if python3 -I -m pytest -q -p no:cacheprovider -c /dev/null --rootdir=/tests --confcutdir=/tests test_outputs.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
