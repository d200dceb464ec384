"""The delivery engine: topics and queues, consumer groups, acks, redelivery, retry and dead-letter queues."""
