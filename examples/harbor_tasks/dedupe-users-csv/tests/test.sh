#!/bin/bash
# Named rewards in reward.json, one per test file (pytest run from /tests only, as in the other tasks).
cd /tests || exit 1
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
rows=0
python3 -I -m pytest -q -p no:cacheprovider -c /dev/null --rootdir=/tests --confcutdir=/tests test_rows.py && rows=1
order=0
python3 -I -m pytest -q -p no:cacheprovider -c /dev/null --rootdir=/tests --confcutdir=/tests test_order.py && order=1
echo "{\"rows\": $rows, \"order\": $order}" > /logs/verifier/reward.json
