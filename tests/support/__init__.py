"""What the tests share and are not tests themselves: checkers and small pipelines, generated data
(the corpus of odd files), the fake CUDA, a backend for the tests only, a reader of serialized DALI
graphs, the loopback servers (HTTP, SeaweedFS for S3), and the scripts run in child processes
(torchrun ranks, Lightning's Trainer)."""
