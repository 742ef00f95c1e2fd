def slugify(text):
    raise NotImplementedError
