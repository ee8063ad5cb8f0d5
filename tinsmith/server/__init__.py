"""Server assembly: configuration, and the objects (store, worker, engine) the API drives."""
