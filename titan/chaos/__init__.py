"""`titan chaos`: break a local router + replicas on purpose and check that no request is lost."""
