"""The job defaults (`job.yaml`) and the original AgentJet's config classes that rollout
scripts import for the task readers (`ajet_config_schema`)."""
