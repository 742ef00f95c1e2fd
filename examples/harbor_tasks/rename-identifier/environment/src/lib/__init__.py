foo_client = object()
