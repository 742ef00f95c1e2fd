def test_top():
    lines = open("/app/top_words.txt").read().split("\n")
    assert [line for line in lines if line] == ["the 7", "cat 3", "dog 3", "a 2", "on 2"]
