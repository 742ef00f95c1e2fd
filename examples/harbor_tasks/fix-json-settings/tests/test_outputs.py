import json


def test_settings():
    assert json.load(open("/app/settings.json")) == {"name": "api", "retries": 5, "hosts": ["a", "b"],
                                                      "limits": {"rps": 100, "burst": 20}}
