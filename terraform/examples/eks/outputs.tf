output "helm_values_yaml" {
  description = "Values for `helm install spotjob charts/spotjob -f`: the controller's IRSA role, its ServiceAccount name, the interruption queue."
  value       = yamlencode(local.helm_values)
}

output "checkpoint_bucket" {
  description = "The checkpoint bucket (checkpoint.uri in examples/spotjob-eks.yaml)."
  value       = module.spotjob.checkpoint_bucket
}

output "checkpoint_uris" {
  description = "Where each namespace's jobs may write checkpoints."
  value       = module.spotjob.checkpoint_uris
}

output "training_role_arns" {
  description = "The IRSA role of each namespace's training ServiceAccount (eks.amazonaws.com/role-arn in examples/spotjob-eks.yaml)."
  value       = module.spotjob.training_role_arns
}

output "interruption_queue_url" {
  description = "spotjob's own interruption queue."
  value       = module.spotjob.interruption_queue_url
}

output "interruption_event_rule_arns" {
  description = "The EventBridge rules that feed the queue."
  value       = module.spotjob.interruption_event_rule_arns
}
