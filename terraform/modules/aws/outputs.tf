output "checkpoint_bucket" {
  description = "The checkpoint bucket's name."
  value       = aws_s3_bucket.this.bucket
}

output "checkpoint_bucket_arn" {
  description = "The checkpoint bucket's ARN."
  value       = aws_s3_bucket.this.arn
}

output "checkpoint_uris" {
  description = "Per training identity, the URI its jobs' checkpoint.uri must lie under: s3://<bucket>/<prefix>/<job>."
  value       = { for k, v in var.training_identities : k => "s3://${aws_s3_bucket.this.bucket}/${v.prefix}" }
}

output "training_role_arns" {
  description = "Per training identity, the IRSA role to annotate its ServiceAccount with (eks.amazonaws.com/role-arn)."
  value       = { for k, role in aws_iam_role.training : k => role.arn }
}

output "controller_role_arn" {
  description = "The controller's IRSA role: the chart's serviceAccount.aws.roleArn."
  value       = aws_iam_role.controller.arn
}

output "interruption_queue_url" {
  description = "spotjob's own interruption queue: the chart's interruptionQueue.url (null without a queue)."
  value       = var.create_interruption_queue ? aws_sqs_queue.this[0].url : null
}

output "interruption_queue_arn" {
  description = "The interruption queue's ARN (null without a queue)."
  value       = var.create_interruption_queue ? aws_sqs_queue.this[0].arn : null
}

output "interruption_event_rule_arns" {
  description = "The EventBridge rules that feed the queue, by event: spot-interruption, rebalance, state-change."
  value       = { for k, rule in aws_cloudwatch_event_rule.this : k => rule.arn }
}

output "region" {
  description = "The region everything is in: the chart's interruptionQueue.region."
  value       = local.region
}

output "node_group_name" {
  description = "The spot GPU node group's name (null when none was created)."
  value       = local.create_node_group ? aws_eks_node_group.this[0].node_group_name : null
}

output "helm_values" {
  description = "The chart values this module determines, to merge into the spotjob release's values (yamlencode it into a -f file)."
  value = {
    serviceAccount = {
      name = var.controller_service_account
      aws  = { roleArn = aws_iam_role.controller.arn }
    }
    interruptionQueue = {
      url    = var.create_interruption_queue ? aws_sqs_queue.this[0].url : ""
      region = var.create_interruption_queue ? local.region : ""
    }
  }
}
