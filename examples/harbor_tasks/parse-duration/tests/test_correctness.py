import importlib.util

spec = importlib.util.spec_from_file_location("duration", "/app/duration.py")
duration = importlib.util.module_from_spec(spec)
spec.loader.exec_module(duration)


def test_values():
    p = duration.parse_duration
    assert p("45s") == 45
    assert p("1h30m") == 5400
    assert p("2d") == 172800
    assert p("1h 5m 10s") == 3910
    assert p("0s") == 0
