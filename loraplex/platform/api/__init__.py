"""The FastAPI layer: routes translate HTTP to service calls and back, nothing more."""
