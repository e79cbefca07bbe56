"""The OpenAI-compatible server: ``hylo serve`` (see ``app.create_app``)."""
