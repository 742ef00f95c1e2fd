def test_count():
    assert open("/app/error_count.txt").read().strip() == "4"
