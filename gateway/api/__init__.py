"""The gateway's HTTP routes, one module per resource: files, batches, completions (chat and text), jobs.

Every route of the OpenAI-shaped API lives here (tests/deploy/test_layout.py checks); the modules are thin:
the work is in files/, batches/, live/ and webhooks/. The dashboard's pages are their own room (ui/).
"""
