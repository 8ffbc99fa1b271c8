#!/usr/bin/env bash
# Creates, once, the AWS security group that cluster/gpu.yaml's nodes run in: SSH from the address
# range you give and nothing else from outside; every port between the cluster's own nodes (Ray's
# GCS, raylets, object transfers, NFS to EFS).  Ray's launcher would otherwise create a group with
# SSH open to 0.0.0.0/0.  Prints the group's id: put it in gpu.yaml's SecurityGroupIds (both node
# types).  Running it again prints the existing group's id.
#
#   bash cluster/aws-security-group.sh 203.0.113.7/32 [VPC_ID] [REGION]
#
# (your address: `curl -s https://checkip.amazonaws.com`/32).  Uses your usual AWS credentials.
set -euo pipefail
cidr=${1:?usage: bash cluster/aws-security-group.sh YOUR_CIDR [VPC_ID] [REGION], e.g. 203.0.113.7/32}
case "$cidr" in
  0.0.0.0/0 | ::/0) echo "refusing $cidr: that is SSH from anywhere; give your own address range" >&2; exit 2 ;;
  */*) ;;
  *) echo "$cidr is not a CIDR range (e.g. 203.0.113.7/32)" >&2; exit 2 ;;
esac
region=${3:-us-west-2}
vpc=${2:-$(aws ec2 describe-vpcs --region "$region" --filters Name=is-default,Values=true --query 'Vpcs[0].VpcId' --output text)}
name=dpsm-ray-gpu
existing=$(aws ec2 describe-security-groups --region "$region" --filters "Name=group-name,Values=$name" "Name=vpc-id,Values=$vpc" \
  --query 'SecurityGroups[0].GroupId' --output text)
if [ "$existing" != "None" ]; then
  echo "$existing"
  exit 0
fi
group=$(aws ec2 create-security-group --region "$region" --vpc-id "$vpc" --group-name "$name" \
  --description "dpsm_ray GPU cluster: SSH from $cidr, every port between the cluster's nodes" --query GroupId --output text)
aws ec2 authorize-security-group-ingress --region "$region" --group-id "$group" --ip-permissions \
  "IpProtocol=tcp,FromPort=22,ToPort=22,IpRanges=[{CidrIp=$cidr,Description=SSH from the user}]" \
  "IpProtocol=-1,UserIdGroupPairs=[{GroupId=$group,Description=the cluster's own nodes}]" > /dev/null
echo "$group"
