import json


def test_summary():
    text = open("/app/summary.json").read()
    data = json.loads(text)
    assert data == {"alice": 10.3, "bob": 2.5, "carol": 1.25}
    assert list(data) == sorted(data)
