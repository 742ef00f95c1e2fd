def test_env():
    assert open("/app/.env").read() == (
        "# database\nDB_HOST=db.internal\nDB_PORT=6543\n\n# app\nAPP_NAME=shop\nDEBUG=false\n")
