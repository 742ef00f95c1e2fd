from lib import foo_client

foo_client.connect()
foo_client_factory = 1
