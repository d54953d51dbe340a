"""Test helpers shipped with muxproxy: the fake LLM backend (:mod:`muxproxy.testing.fakellm`)."""
