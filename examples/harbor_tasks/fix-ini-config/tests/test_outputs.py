import configparser


def test_loads_and_values():
    c = configparser.ConfigParser()
    c.read_string(open("/app/service.ini").read())
    assert c["server"]["port"] == "8080"
    assert c["server"]["host"] == "0.0.0.0"
    assert c["database"]["url"] == "postgres://db:5432/app"
    assert c["database"]["pool"] == "5"
