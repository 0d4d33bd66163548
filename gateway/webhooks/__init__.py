"""Batch webhooks: Standard Webhooks deliveries (delivery) signed with a secret per API key (secrets)."""
