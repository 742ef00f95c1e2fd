import importlib.util

import pytest

spec = importlib.util.spec_from_file_location("duration", "/app/duration.py")
duration = importlib.util.module_from_spec(spec)
spec.loader.exec_module(duration)


@pytest.mark.parametrize("text", ["", "5x", "1m1h", "h", "1.5h", "1h1h", "10"])
def test_rejects(text):
    with pytest.raises(ValueError):
        duration.parse_duration(text)
