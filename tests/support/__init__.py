"""What the tests share: a throwaway redis-server, tiny random-weight models, the HF reference, the gateway harness."""
