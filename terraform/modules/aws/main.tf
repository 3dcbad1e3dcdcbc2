# spotjob on AWS: the checkpoint bucket, IRSA roles for the training pods and the controller,
# spotjob's own interruption queue fed by EventBridge, and optionally a spot GPU node group.

data "aws_partition" "current" {}
data "aws_caller_identity" "current" {}
data "aws_region" "current" {}

locals {
  partition  = data.aws_partition.current.partition
  account_id = data.aws_caller_identity.current.account_id
  region     = data.aws_region.current.name

  bucket_name = coalesce(var.bucket_name, "${var.name}-checkpoints-${local.account_id}")
  bucket_arn  = "arn:${local.partition}:s3:::${local.bucket_name}"

  # arn:aws:iam::ACCOUNT:oidc-provider/oidc.eks.REGION.amazonaws.com/id/ID -> oidc.eks.REGION.amazonaws.com/id/ID
  oidc_issuer = element(split(":oidc-provider/", var.oidc_provider_arn), 1)

  # The EC2 events the controller turns into Node annotations: spotjob's own rules on its own queue.
  all_interruption_events = {
    spot-interruption = {
      description = "EC2 Spot Instance Interruption Warning: two minutes before the instance is taken"
      pattern = jsonencode({
        source      = ["aws.ec2"]
        detail-type = ["EC2 Spot Instance Interruption Warning"]
      })
    }
    rebalance = {
      description = "EC2 Instance Rebalance Recommendation: the instance is at elevated risk of interruption"
      pattern = jsonencode({
        source      = ["aws.ec2"]
        detail-type = ["EC2 Instance Rebalance Recommendation"]
      })
    }
    state-change = {
      description = "EC2 Instance State-change Notification: the instance is stopping or gone, or runs again"
      # running: an instance stopped (a spot interruption set to stop) and started again keeps its
      # Node name; the controller removes the notice of its stop from that Node.
      pattern = jsonencode({
        source      = ["aws.ec2"]
        detail-type = ["EC2 Instance State-change Notification"]
        detail      = { state = ["stopping", "stopped", "shutting-down", "terminated", "running"] }
      })
    }
  }
  interruption_events = { for k, v in local.all_interruption_events : k => v if var.create_interruption_queue }

  kms_statements = var.kms_key_arn == null ? [] : [var.kms_key_arn]
}

# -- checkpoint bucket ------------------------------------------------------------------------------

resource "aws_s3_bucket" "this" {
  bucket        = local.bucket_name
  force_destroy = var.force_destroy
  tags          = var.tags

  lifecycle {
    # The default bucket name begins with name, and S3 refused one beginning with a prefix it keeps
    # at apply (bucket_name's validation refuses those; a variable's cannot read another variable).
    precondition {
      condition     = var.bucket_name != null || !can(regex("^(xn--|sthree-|amzn-s3-demo-)", var.name))
      error_message = "name \"${var.name}\" makes the bucket name \"${local.bucket_name}\", which S3 refuses: a bucket name may not begin with xn--, sthree- or amzn-s3-demo-: choose another name, or give bucket_name."
    }
  }
}

resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket = aws_s3_bucket.this.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

# Versioning: a checkpoint deleted by retention, or by mistake, stays recoverable for
# noncurrent_version_expiration_days.
resource "aws_s3_bucket_versioning" "this" {
  bucket = aws_s3_bucket.this.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = var.kms_key_arn == null ? "AES256" : "aws:kms"
      kms_master_key_id = var.kms_key_arn
    }
    bucket_key_enabled = var.kms_key_arn != null
  }

  lifecycle {
    # S3 encrypts only with a key in the bucket's region. Another region's key was accepted here,
    # and every checkpoint write failed afterwards.
    precondition {
      condition     = var.kms_key_arn == null || try(split(":", var.kms_key_arn)[3] == local.region, false)
      error_message = "kms_key_arn is a key in ${try(split(":", var.kms_key_arn)[3], "another region")}, but the bucket is in ${local.region}: S3 encrypts only with a key in the bucket's region. Use a key (or a multi-Region key's replica) in ${local.region}."
    }
  }
}

# Only what spotjob already let go of expires: noncurrent versions (checkpoints its retention
# deleted), the delete markers left when those are gone, and multipart uploads a preemption cut off.
# Current objects never expire: a job's newest valid checkpoint must not vanish however long the job
# is paused.
resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    id     = "expire-deleted-checkpoints"
    status = "Enabled"

    # The whole bucket. An explicit empty prefix, not `filter {}`: S3 (and moto) answer with
    # <Prefix/>, which the provider compares equal only to this form.
    filter {
      prefix = ""
    }

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_expiration_days
    }

    expiration {
      expired_object_delete_marker = true
    }
  }

  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"

    filter {
      prefix = ""
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_upload_days
    }
  }

  depends_on = [aws_s3_bucket_versioning.this]
}

data "aws_iam_policy_document" "bucket" {
  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [local.bucket_arn, "${local.bucket_arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }

  statement {
    sid       = "DenyOutdatedTLS"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [local.bucket_arn, "${local.bucket_arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "NumericLessThan"
      variable = "s3:TlsVersion"
      values   = ["1.2"]
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.bucket.json

  # S3 refuses a bucket policy while the public access block is being written.
  depends_on = [aws_s3_bucket_public_access_block.this]
}

# -- training pods: one role per identity, limited to its prefix -------------------------------------

data "aws_iam_policy_document" "training_trust" {
  for_each = var.training_identities

  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]

    principals {
      type        = "Federated"
      identifiers = [var.oidc_provider_arn]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:sub"
      values   = ["system:serviceaccount:${each.value.namespace}:${each.value.service_account}"]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "training" {
  for_each = var.training_identities

  # Listing only under the prefix: a job finds its own checkpoints, never another team's.
  statement {
    sid       = "ListJobPrefix"
    actions   = ["s3:ListBucket"]
    resources = [local.bucket_arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [each.value.prefix, "${each.value.prefix}/*"]
    }
  }

  # Shards, per-rank state and manifests (create-only commits are PutObject with If-None-Match;
  # multipart uploads are PutObject too), retention's deletes, and the abort of a multipart upload
  # that failed. agent/storage/s3.py never lists an upload's parts. Rank 0's check that the store
  # enforces If-None-Match writes and deletes one probe under <prefix>/.spotjob/probes/: no more
  # than this. (The controller never probes: it has no DeleteObject.)
  statement {
    sid = "ReadWriteJobPrefix"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
    ]
    resources = ["${local.bucket_arn}/${each.value.prefix}/*"]
  }

  dynamic "statement" {
    for_each = local.kms_statements
    content {
      sid       = "UseBucketKey"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = [statement.value]
    }
  }
}

resource "aws_iam_role" "training" {
  for_each = var.training_identities

  name                 = "${var.name}-training-${each.key}"
  description          = "spotjob training pods (${each.value.namespace}/${each.value.service_account}): checkpoints under s3://${local.bucket_name}/${each.value.prefix}/"
  assume_role_policy   = data.aws_iam_policy_document.training_trust[each.key].json
  max_session_duration = 43200
  tags                 = var.tags

  lifecycle {
    # IAM role names are at most 64 characters. The provider refused a longer one at plan without
    # naming the variables that made it (a variable's validation cannot read another variable).
    precondition {
      condition     = length("${var.name}-training-${each.key}") <= 64
      error_message = "The IAM role name \"${var.name}-training-${each.key}\" is longer than 64 characters: shorten name or the training_identities key \"${each.key}\" (together at most 54 characters)."
    }
  }
}

resource "aws_iam_role_policy" "training" {
  for_each = var.training_identities

  name   = "checkpoints"
  role   = aws_iam_role.training[each.key].id
  policy = data.aws_iam_policy_document.training[each.key].json
}

# -- the controller: read manifests, keep the ownership records, read its queue -----------------------

data "aws_iam_policy_document" "controller_trust" {
  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]

    principals {
      type        = "Federated"
      identifiers = [var.oidc_provider_arn]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:sub"
      values   = ["system:serviceaccount:${var.controller_namespace}:${var.controller_service_account}"]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "controller" {
  statement {
    sid       = "ListCheckpoints"
    actions   = ["s3:ListBucket"]
    resources = [local.bucket_arn]
  }

  # Manifests are what the controller judges a flush by; a manifest or a writer's claim (WRITER.json)
  # at a new job's URI says it is a checkpoint's own folder, which its first look refuses. It never
  # reads shards.
  statement {
    sid       = "ReadManifests"
    actions   = ["s3:GetObject"]
    resources = ["${local.bucket_arn}/*/MANIFEST.json", "${local.bucket_arn}/*/WRITER.json"]
  }

  # <uri>/.spotjob/: the URI's owner record and the attempt records the controller writes
  # (create-only) before it starts an attempt, so an older attempt's workers are fenced.
  statement {
    sid       = "OwnershipAndAttemptRecords"
    actions   = ["s3:GetObject", "s3:PutObject"]
    resources = ["${local.bucket_arn}/.spotjob/*", "${local.bucket_arn}/*/.spotjob/*"]
  }

  # The two calls the queue reader makes (orchestrator/k8s/interruption_queue.py SqsQueue): it is
  # given the queue's URL, so it never looks the queue up or reads its attributes.
  dynamic "statement" {
    for_each = var.create_interruption_queue ? [aws_sqs_queue.this[0].arn] : []
    content {
      sid       = "ReadInterruptionQueue"
      actions   = ["sqs:ReceiveMessage", "sqs:DeleteMessage"]
      resources = [statement.value]
    }
  }

  dynamic "statement" {
    for_each = local.kms_statements
    content {
      sid       = "UseBucketKey"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = [statement.value]
    }
  }
}

resource "aws_iam_role" "controller" {
  name                 = "${var.name}-controller"
  description          = "spotjob controller (${var.controller_namespace}/${var.controller_service_account}): checkpoint manifests and the interruption queue"
  assume_role_policy   = data.aws_iam_policy_document.controller_trust.json
  max_session_duration = 43200
  tags                 = var.tags
}

resource "aws_iam_role_policy" "controller" {
  name   = "spotjob-controller"
  role   = aws_iam_role.controller.id
  policy = data.aws_iam_policy_document.controller.json
}

# -- spotjob's own interruption queue ---------------------------------------------------------------

locals {
  queue_name = "${var.name}-interruptions"
  queue_arn  = "arn:${local.partition}:sqs:${local.region}:${local.account_id}:${local.queue_name}"
}

# The queue policy is set with the queue (not in an aws_sqs_queue_policy of its own): one
# propagation wait instead of two.
resource "aws_sqs_queue" "this" {
  count = var.create_interruption_queue ? 1 : 0

  name                      = local.queue_name
  message_retention_seconds = var.queue_message_retention_seconds
  sqs_managed_sse_enabled   = true
  policy                    = data.aws_iam_policy_document.queue[0].json
  tags                      = var.tags
}

data "aws_iam_policy_document" "queue" {
  count = var.create_interruption_queue ? 1 : 0

  # Only EventBridge, and only for this module's rules.
  statement {
    sid       = "EventBridgeSendsInterruptions"
    actions   = ["sqs:SendMessage"]
    resources = [local.queue_arn]

    principals {
      type        = "Service"
      identifiers = ["events.amazonaws.com"]
    }

    condition {
      test     = "ArnEquals"
      variable = "aws:SourceArn"
      values   = [for rule in aws_cloudwatch_event_rule.this : rule.arn]
    }
  }

  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["sqs:*"]
    resources = [local.queue_arn]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_cloudwatch_event_rule" "this" {
  for_each = local.interruption_events

  name          = "${var.name}-${each.key}"
  description   = "spotjob: ${each.value.description}"
  event_pattern = each.value.pattern
  tags          = var.tags
}

resource "aws_cloudwatch_event_target" "this" {
  for_each = local.interruption_events

  rule      = aws_cloudwatch_event_rule.this[each.key].name
  target_id = "spotjob-interruption-queue"
  arn       = aws_sqs_queue.this[0].arn
}

# -- optional: an EKS managed node group of spot GPU instances -----------------------------------------

locals {
  create_node_group = var.node_group != null
  create_node_role  = local.create_node_group && try(var.node_group.node_role_arn, null) == null
  node_role_policies = local.create_node_role ? toset([
    "AmazonEKSWorkerNodePolicy",
    "AmazonEKS_CNI_Policy",
    "AmazonEC2ContainerRegistryReadOnly",
  ]) : toset([])
}

data "aws_iam_policy_document" "node_trust" {
  count = local.create_node_role ? 1 : 0

  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "node" {
  count = local.create_node_role ? 1 : 0

  name               = "${var.name}-gpu-spot-node"
  description        = "spotjob spot GPU node group nodes"
  assume_role_policy = data.aws_iam_policy_document.node_trust[0].json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "this" {
  for_each = local.node_role_policies

  role       = aws_iam_role.node[0].name
  policy_arn = "arn:${local.partition}:iam::aws:policy/${each.value}"
}

resource "aws_eks_node_group" "this" {
  count = local.create_node_group ? 1 : 0

  cluster_name    = var.node_group.cluster_name
  node_group_name = "${var.name}-gpu-spot"
  node_role_arn   = local.create_node_role ? aws_iam_role.node[0].arn : var.node_group.node_role_arn
  subnet_ids      = var.node_group.subnet_ids
  capacity_type   = "SPOT"
  instance_types  = var.node_group.instance_types
  ami_type        = var.node_group.ami_type
  disk_size       = var.node_group.disk_size

  scaling_config {
    min_size     = var.node_group.min_size
    desired_size = var.node_group.desired_size
    max_size     = var.node_group.max_size
  }

  update_config {
    max_unavailable = 1
  }

  # EKS adds eks.amazonaws.com/capacityType=SPOT itself; examples/spotjob-eks.yaml selects it.
  labels = merge({ "spotjob.dev/pool" = "gpu-spot" }, var.node_group.labels)

  # Only pods that tolerate GPUs land here (examples/spotjob-eks.yaml does).
  taint {
    key    = "nvidia.com/gpu"
    value  = "true"
    effect = "NO_SCHEDULE"
  }

  tags = var.tags

  lifecycle {
    # The cluster autoscaler (or you) move desired_size; Terraform should not move it back.
    ignore_changes = [scaling_config[0].desired_size]
  }

  depends_on = [aws_iam_role_policy_attachment.this]
}

# -- destroy guard ----------------------------------------------------------------------------------

# S3 refuses to delete a bucket that holds any object version, but `terraform destroy` only gets
# there after removing everything that depends on the bucket: its policy, public access block,
# ownership controls, encryption and lifecycle (versioning is suspended), and the roles and the
# queue. A refused destroy used to leave the checkpoints in a bucket stripped of all of that. This
# depends on every resource here, so a destroy removes it first: without force_destroy (as applied,
# in the state) it fails, and nothing else is touched. A new name or bucket_name replaces the
# bucket, and so this too (triggers_replace): refused the same way.
resource "terraform_data" "this" {
  input            = var.force_destroy
  triggers_replace = local.bucket_name

  provisioner "local-exec" {
    when    = destroy
    command = self.input ? "exit 0" : "echo spotjob: refusing to destroy: force_destroy is false, and the checkpoint bucket would go, by terraform destroy or by a new name or bucket_name, which replaces it. To delete the bucket and every checkpoint in it, apply force_destroy = true first. To keep the bucket, see Destroying in the module README. 1>&2 && exit 1"
  }

  depends_on = [
    aws_s3_bucket.this,
    aws_s3_bucket_ownership_controls.this,
    aws_s3_bucket_public_access_block.this,
    aws_s3_bucket_versioning.this,
    aws_s3_bucket_server_side_encryption_configuration.this,
    aws_s3_bucket_lifecycle_configuration.this,
    aws_s3_bucket_policy.this,
    aws_iam_role.training,
    aws_iam_role_policy.training,
    aws_iam_role.controller,
    aws_iam_role_policy.controller,
    aws_sqs_queue.this,
    aws_cloudwatch_event_rule.this,
    aws_cloudwatch_event_target.this,
    aws_iam_role.node,
    aws_iam_role_policy_attachment.this,
    aws_eks_node_group.this,
  ]
}
