"""What the tests share and are not tests themselves: generated data (images and shards, the corpus
of odd files), the backends and devices the contract suite runs on, checkers and small pipelines,
the fake CUDA, a backend for the tests only, a reader of serialized DALI graphs, the loopback
servers (HTTP, SeaweedFS for S3), and the scripts run in child processes (torchrun ranks,
Lightning's Trainer). conftest makes the fixtures among them available to every test module."""
