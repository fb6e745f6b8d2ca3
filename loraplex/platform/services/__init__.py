"""Business logic shared by the HTTP API, the CLI and the Gradio console."""
