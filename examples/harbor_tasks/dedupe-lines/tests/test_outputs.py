def test_lines():
    assert open("/app/list.txt").read() == "pear\napple\nPear\nfig\nkiwi\n"
