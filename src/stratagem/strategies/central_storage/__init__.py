"""CentralStorageStrategy: parameters and optimizer state once on one device, computation on every replica."""
